#!/usr/bin/env bash
# `make test-docker`: run the docker/docker-compose.yml job (stock scheduler, 2 lazy servers, 2 stock MXNet workers
# running the demo's wide & deep job) on a Docker engine of our own, fully offline, and check the result.
#
#  1. installs docker.io containerd runc debootstrap docker-compose iproute2 with apt if missing (needs root);
#  2. starts dockerd in a network namespace of its own (docker0 and its iptables rules stay out of the root
#     namespace; containers get no route out, which they do not need) with a private data root, exec root, socket
#     and pidfile: `nsenter --net=/run/netns/NS dockerd ...` (`ip netns exec` fails: it remounts /sys);
#  3. makes an offline base image: `debootstrap --variant=minbase bookworm` with python3 (3.11) and the libraries
#     libmxnet.so needs, `docker import`ed (the rootfs tarball is cached across runs);
#  4. `pip download`s the pinned wheels on the host into a staged build context and builds docker/Dockerfile with
#     --build-arg BASE=<offline image> (the Dockerfile installs from the wheels with --no-index);
#  5. runs the compose file to completion under a deadline, checks that both workers exited 0 (124: a hang), that
#     the checkpoint is on the volume (loaded with mx.nd.load, rows present, no problems reported) and that both
#     servers wrote their snapshots;
#  6. tears everything down in a trap: compose down -v, dockerd stopped by the PID in its pidfile, namespace deleted.
#
# Environment: KVSTORE_LAZY_DOCKER_CACHE (default /var/cache/kvstore-lazy-docker: rootfs tarball, wheels, docker
# data root), KVSTORE_LAZY_DOCKER_DEADLINE (seconds for the compose job, default 300), KVSTORE_LAZY_DOCKER_FRESH=1
# (start from an empty docker data root), KVSTORE_LAZY_DOCKER_KEEP=1 (leave the engine running; print how to reach it).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${KVSTORE_LAZY_DOCKER_CACHE:-/var/cache/kvstore-lazy-docker}"
DEADLINE="${KVSTORE_LAZY_DOCKER_DEADLINE:-300}"
NS="kvstore-lazy-docker"
RUN="/run/kvstore-lazy-docker"
SOCK="$RUN/docker.sock"
PIDFILE="$RUN/dockerd.pid"
PROJECT="kvltest"
IMAGE="kvstore-lazy:test"
# gcc + libc6-dev build kvstore_lazy/store/kernels.c in the image
INCLUDE="python3,python3-venv,python3-dev,libgomp1,libquadmath0,iproute2,ca-certificates,gcc,libc6-dev"
BASE_IMAGE="kvstore-lazy-base:bookworm-$(echo "$INCLUDE" | md5sum | cut -c1-8)"
COMPOSE_FILE="$ROOT/docker/docker-compose.yml"
export DOCKER_HOST="unix://$SOCK" COMPOSE_PROJECT_NAME="$PROJECT" KVSTORE_LAZY_IMAGE="$IMAGE" DOCKER_BUILDKIT=0
export COMPOSE_HTTP_TIMEOUT=120
T0=$(date +%s)

say() { printf '[docker-test %4ds] %s\n' "$(( $(date +%s) - T0 ))" "$*"; }
die() { say "FAIL: $*"; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (dockerd, network namespaces, debootstrap)"

# --- 1. packages ---------------------------------------------------------------------------------------------------
need=()
command -v dockerd >/dev/null || need+=(docker.io)
command -v containerd >/dev/null || need+=(containerd)
command -v runc >/dev/null || need+=(runc)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v docker-compose >/dev/null || need+=(docker-compose)
command -v ip >/dev/null || need+=(iproute2)
command -v nsenter >/dev/null || need+=(util-linux)
if [ ${#need[@]} -gt 0 ]; then
    say "installing with apt: ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
# Debian's client matches Debian's daemon (20.10); another `docker` earlier on PATH may be a newer client
DOCKER=/usr/bin/docker
[ -x "$DOCKER" ] || DOCKER="$(command -v docker)"
docker() { "$DOCKER" "$@"; }
compose() { docker-compose -f "$COMPOSE_FILE" -p "$PROJECT" "$@"; }

# --- teardown (idempotent; also cleans what a killed earlier run left) ---------------------------------------------
stop_dockerd() {
    local pid
    [ -f "$PIDFILE" ] || return 0
    pid="$(cat "$PIDFILE" 2>/dev/null || true)"
    if [ -n "$pid" ] && [ -d "/proc/$pid" ] && grep -q dockerd "/proc/$pid/comm" 2>/dev/null; then
        say "stopping dockerd (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 150); do [ -d "/proc/$pid" ] || break; sleep 0.2; done
        if [ -d "/proc/$pid" ]; then say "dockerd (pid $pid) still up after 30 s: SIGKILL"; kill -KILL "$pid" || true; fi
    fi
    rm -f "$PIDFILE"
}
teardown() {
    local rc=$?
    trap - EXIT INT TERM
    if [ "${KVSTORE_LAZY_DOCKER_KEEP:-0}" = 1 ] && [ -S "$SOCK" ]; then
        say "KVSTORE_LAZY_DOCKER_KEEP=1: engine left running: DOCKER_HOST=$DOCKER_HOST; stop with: kill \$(cat $PIDFILE); ip netns del $NS"
        exit "$rc"
    fi
    if [ -S "$SOCK" ] && docker info >/dev/null 2>&1; then
        timeout 60 docker-compose -f "$COMPOSE_FILE" -p "$PROJECT" down -v --remove-orphans -t 5 >/dev/null 2>&1 || \
            say "warning: compose down failed"
    fi
    stop_dockerd
    ip netns del "$NS" 2>/dev/null || true
    say "torn down (exit $rc, $(( $(date +%s) - T0 )) s in all)"
    exit "$rc"
}
# Long steps run in the background under `wait`, so that a signal is acted on at once (bash defers traps while a
# foreground command runs) and the step is ended by its PID.
CHILD=""
on_signal() {
    if [ -n "$CHILD" ] && kill -0 "$CHILD" 2>/dev/null; then kill -TERM "$CHILD" 2>/dev/null || true; wait "$CHILD" 2>/dev/null || true; fi
    CHILD=""
    exit "$1"
}
run() {   # run CMD...: in the background, waited for; returns its status
    local rc=0
    "$@" &
    CHILD=$!
    wait "$CHILD" || rc=$?
    CHILD=""
    return "$rc"
}
trap teardown EXIT
trap 'on_signal 130' INT
trap 'on_signal 143' TERM

stop_dockerd                       # a previous run killed before its trap ran
ip netns del "$NS" 2>/dev/null || true

# --- 2. dockerd in its own network namespace -----------------------------------------------------------------------
mkdir -p "$CACHE" "$RUN"
if [ "${KVSTORE_LAZY_DOCKER_FRESH:-0}" = 1 ]; then rm -rf "$CACHE/data-root"; fi
ip netns add "$NS"
ip -n "$NS" link set lo up
say "starting dockerd in netns $NS (data root $CACHE/data-root, socket $SOCK)"
nsenter --net="/run/netns/$NS" dockerd \
    --data-root "$CACHE/data-root" --exec-root "$RUN/exec" -H "unix://$SOCK" --pidfile "$PIDFILE" \
    --storage-driver overlay2 --log-level warn >"$RUN/dockerd.log" 2>&1 &
for i in $(seq 1 120); do
    if docker info >/dev/null 2>&1; then break; fi
    if ! kill -0 $! 2>/dev/null; then tail -20 "$RUN/dockerd.log"; die "dockerd exited (log: $RUN/dockerd.log)"; fi
    [ "$i" = 120 ] && { tail -20 "$RUN/dockerd.log"; die "dockerd not ready after 60 s"; }
    sleep 0.5
done
say "dockerd up: $(docker version -f 'server {{.Server.Version}}, API {{.Server.APIVersion}}')"

# --- 3. offline base image -----------------------------------------------------------------------------------------
MIRROR="$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
BASE_TAR="$CACHE/bookworm-$(echo "$INCLUDE" | md5sum | cut -c1-8).tar"
if [ ! -s "$BASE_TAR" ]; then
    say "debootstrap bookworm (minbase + $INCLUDE) from $MIRROR"
    rootfs="$CACHE/rootfs.tmp"
    rm -rf "$rootfs"
    run debootstrap --variant=minbase --include="$INCLUDE" bookworm "$rootfs" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 || \
        { tail -20 "$CACHE/debootstrap.log"; die "debootstrap failed (log: $CACHE/debootstrap.log)"; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -cf "$BASE_TAR.tmp" . && mv "$BASE_TAR.tmp" "$BASE_TAR"
    rm -rf "$rootfs"
fi
if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    say "docker import $BASE_TAR as $BASE_IMAGE"
    docker import "$BASE_TAR" "$BASE_IMAGE" >/dev/null
fi

# --- 4. wheels and the image ---------------------------------------------------------------------------------------
PY="$ROOT/.venv/bin/python"
[ -x "$PY" ] || PY="$(command -v python3.11 || command -v python3)"
pins=()
for pkg in mxnet numpy pyzmq; do
    pin="$(grep -E "^$pkg==" "$ROOT/requirements.txt")" || die "no $pkg pin in requirements.txt"
    pins+=("$pin")
done
say "pip download ${pins[*]} setuptools wheel (for Python 3.11, manylinux x86_64)"
mkdir -p "$CACHE/wheels"
"$PY" -m pip download -q --disable-pip-version-check -d "$CACHE/wheels" \
    --only-binary=:all: --python-version 3.11 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 \
    "${pins[@]}" "setuptools>=70.1" wheel 2>&1 | grep -v "is ignored: it is neither" || true
ls "$CACHE"/wheels/mxnet-*.whl >/dev/null 2>&1 || die "wheel download failed"

CTX="$RUN/context"
rm -rf "$CTX"
mkdir -p "$CTX/docker/wheels"
cp -a "$ROOT/kvstore_lazy" "$ROOT/scripts" "$ROOT/pyproject.toml" "$ROOT/requirements.txt" "$ROOT/README.md" "$CTX/"
cp -a "$ROOT/docker/Dockerfile" "$CTX/docker/"
cp -al "$CACHE"/wheels/*.whl "$CTX/docker/wheels/" 2>/dev/null || cp -a "$CACHE"/wheels/*.whl "$CTX/docker/wheels/"
find "$CTX" -name __pycache__ -prune -exec rm -rf {} +
say "docker build --build-arg BASE=$BASE_IMAGE -t $IMAGE"
run timeout 1200 "$DOCKER" build --build-arg BASE="$BASE_IMAGE" -f "$CTX/docker/Dockerfile" -t "$IMAGE" "$CTX" \
    >"$RUN/build.log" 2>&1 || { tail -30 "$RUN/build.log"; die "image build failed (log: $RUN/build.log)"; }
rm -rf "$CTX"
say "image built: $(docker run --rm --network none "$IMAGE" python -c 'import mxnet, numpy, zmq, kvstore_lazy; print("mxnet", mxnet.__version__, "numpy", numpy.__version__, "pyzmq", zmq.__version__)' 2>&1 | tail -1)"

# --- 5. the compose job --------------------------------------------------------------------------------------------
compose config -q
compose down -v --remove-orphans -t 5 >/dev/null 2>&1 || true     # leftovers of an earlier run
say "docker-compose up (deadline ${DEADLINE}s)"
t_job=$(date +%s)
up_rc=0
run timeout --kill-after=15 "$DEADLINE" docker-compose -f "$COMPOSE_FILE" -p "$PROJECT" up --no-build --no-color || up_rc=$?
job_s=$(( $(date +%s) - t_job ))
[ "$up_rc" = 124 ] || [ "$up_rc" = 137 ] && die "HANG: the compose job did not finish within ${DEADLINE}s"
[ "$up_rc" = 0 ] || say "warning: docker-compose up exited $up_rc"

fail=0
for svc in scheduler server0 server1 worker0 worker1; do
    cid="$(compose ps -q "$svc")"
    [ -n "$cid" ] || { say "$svc: no container"; fail=1; continue; }
    state="$(docker inspect -f '{{.State.Status}} {{.State.ExitCode}}' "$cid")"
    code="${state##* }"
    say "$svc: $state"
    if [ "${state%% *}" != exited ] || [ "$code" != 0 ]; then
        case "$svc" in worker*) fail=1 ;; *) say "warning: $svc did not exit 0" ;; esac
    fi
done
[ "$fail" = 0 ] || die "a worker did not exit 0 (job ${job_s}s)"

say "checking the checkpoint and the server snapshots on the volume ${PROJECT}_checkpoints"
docker run --rm -i --network none -v "${PROJECT}_checkpoints:/ckpt" "$IMAGE" python - <<'EOF' || die "checkpoint check failed"
import json, os, sys
import mxnet as mx
out = "/ckpt/wide_deep"
result = json.load(open(os.path.join(out, "result.json")))
path = os.path.join(out, "checkpoint", "wide_deep.params")
arrays = mx.nd.load(path)
sparse = {k: v for k, v in arrays.items() if v.stype == "row_sparse"}
problems = list(result.get("ckpt_problems", []))
if len(sparse) != 8:
    problems.append(f"expected 8 row_sparse weights, found {len(sparse)}")
for name, rows in result.get("ckpt_rows", {}).items():
    arr = arrays.get(f"arg:{name}")
    if arr is None or len(arr.indices) != rows or rows == 0:
        problems.append(f"{name}: {rows} rows reported, checkpoint has {None if arr is None else len(arr.indices)}")
for r in (0, 1):
    if not os.path.exists(f"/ckpt/snapshots/rank{r}/manifest.json"):
        problems.append(f"server rank {r} wrote no snapshot")
print(f"checkpoint {path}: {os.path.getsize(path):,} bytes, {len(arrays)} arrays, rows per sparse weight "
      f"{result.get('ckpt_rows')}; loss {result.get('first_loss'):.4f} -> {result.get('final_loss'):.4f}; "
      f"server snapshots: {sorted(os.listdir('/ckpt/snapshots'))}")
if problems:
    print("PROBLEMS:", *problems, sep="\n  ")
    sys.exit(1)
EOF
say "PASS: compose job finished in ${job_s}s, both workers exited 0, checkpoint and snapshots on the volume"
