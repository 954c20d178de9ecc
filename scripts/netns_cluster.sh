#!/usr/bin/env bash
# A test cluster on one machine: "hosts" made from Linux network namespaces.
#
#   scripts/netns_cluster.sh up                 make the hosts (idempotent)
#   scripts/netns_cluster.sh down               end every process left in them (by PID) and delete them (idempotent)
#   scripts/netns_cluster.sh exec HOST CMD...   run CMD on HOST (sched, server0, server1, worker0, worker1)
#   scripts/netns_cluster.sh map                the --netns-map for python -m kvstore_lazy.launch --launcher netns
#   scripts/netns_cluster.sh addr HOST          HOST's address
#   scripts/netns_cluster.sh counters [HOST]    bytes received/sent on each host's link (its veth)
#   scripts/netns_cluster.sh link HOST down|up  take HOST's link down or up (fault tests)
#   scripts/netns_cluster.sh add HOST OCTET     one more host (e.g. a re-created pod) at <subnet>.OCTET (idempotent)
#   scripts/netns_cluster.sh del HOST           end HOST's processes (by PID) and delete it (a pod deleted)
#   scripts/netns_cluster.sh dns NAME HOST|-    resolve the DNS name NAME to HOST's address on every host (- drops
#                                               it), as cluster DNS would: /etc/netns/<ns>/hosts, which
#                                               `ip netns exec` bind-mounts over /etc/hosts (rewritten in place, so
#                                               running processes see the change at their next lookup)
#   scripts/netns_cluster.sh status             what exists
#
# Layout: one namespace per host (<prefix>-sched, -server0, -server1, -worker0, -worker1), each with an "eth0" veth
# and an address in a private /24 (KVL_SUBNET, default 10.213.47.0/24), plugged into a bridge that lives in a
# namespace of its own (<prefix>-sw). The host namespaces have no default route, so nothing leaves them, and nothing
# is added to the root namespace (veth pairs are created directly inside the namespaces). Needs root and iproute2.
# KVL_NETNS_PREFIX (default kvl) names the namespaces; use another prefix to run two clusters side by side.
# Hosts added with `add` and the DNS names of `dns` are kept in /run/kvl-netns/<prefix>/ until `down`.
set -euo pipefail

PREFIX=${KVL_NETNS_PREFIX:-kvl}
SUBNET=${KVL_SUBNET:-10.213.47}
SWITCH="$PREFIX-sw"
STATE="/run/kvl-netns/$PREFIX"
HOSTS=(sched server0 server1 worker0 worker1)
declare -A OCTET=([sched]=10 [server0]=20 [server1]=21 [worker0]=30 [worker1]=31)
if [ -f "$STATE/extra" ]; then
    while read -r h o; do [ -n "$h" ] && HOSTS+=("$h") && OCTET[$h]=$o; done < "$STATE/extra"
fi

die() { echo "netns_cluster: $*" >&2; exit 1; }
need() {
    command -v ip >/dev/null || die "ip (iproute2) is not installed: apt-get install iproute2"
    [ "$(id -u)" = 0 ] || die "must run as root (network namespaces)"
}
ns_of() { [ -n "${OCTET[$1]+x}" ] || die "unknown host '$1' (hosts: ${HOSTS[*]})"; echo "$PREFIX-$1"; }
addr_of() { [ -n "${OCTET[$1]+x}" ] || die "unknown host '$1' (hosts: ${HOSTS[*]})"; echo "$SUBNET.${OCTET[$1]}"; }
exists() { ip netns list | awk '{print $1}' | grep -qx "$1"; }

host_up() {   # host_up HOST: its namespace, veth on the bridge, address (idempotent)
    local h=$1 ns a
    ns=$(ns_of "$h")
    exists "$ns" || ip netns add "$ns"
    ip -n "$ns" link set lo up
    if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
        ip -n "$SWITCH" link del "v-$h" >/dev/null 2>&1 || true
        ip -n "$SWITCH" link add "v-$h" type veth peer name eth0 netns "$ns"
    fi
    ip -n "$SWITCH" link set "v-$h" master br0 up
    a=$(addr_of "$h")
    ip -n "$ns" -4 addr show dev eth0 | grep -q "inet $a/24" || ip -n "$ns" addr add "$a/24" dev eth0
    ip -n "$ns" link set eth0 up
}

up() {
    exists "$SWITCH" || ip netns add "$SWITCH"
    ip -n "$SWITCH" link set lo up
    ip -n "$SWITCH" link show br0 >/dev/null 2>&1 || ip -n "$SWITCH" link add br0 type bridge
    ip -n "$SWITCH" link set br0 up
    for h in "${HOSTS[@]}"; do host_up "$h"; done
    write_hosts
}

end_processes() {   # end_processes NS: SIGTERM every process in NS, SIGKILL what is left after 5 s (by PID)
    local ns=$1 pids
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -n "$pids" ] || return 0
    echo "netns_cluster: ending processes left in $ns: $pids" >&2
    kill -TERM $pids 2>/dev/null || true
    for _ in $(seq 50); do
        [ -z "$(ip netns pids "$ns" 2>/dev/null || true)" ] && break
        sleep 0.1
    done
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
}

down() {
    for ns in $(for h in "${HOSTS[@]}"; do ns_of "$h"; done) "$SWITCH"; do
        rm -rf "/etc/netns/$ns"
        exists "$ns" || continue
        end_processes "$ns"
        ip netns del "$ns"
    done
    rm -rf "$STATE"
}

add() {   # add HOST OCTET
    local h=$1 o=$2
    [[ "$h" =~ ^[a-z][a-z0-9-]{0,11}$ ]] || die "host name '$h': lower-case letters, digits and '-', at most 12"
    [[ "$o" =~ ^[0-9]+$ ]] && [ "$o" -ge 2 ] && [ "$o" -le 254 ] || die "octet '$o': a number in 2..254"
    if [ -n "${OCTET[$h]+x}" ]; then
        [ "${OCTET[$h]}" = "$o" ] || die "host '$h' exists at .${OCTET[$h]}, not .$o"
    else
        for other in "${!OCTET[@]}"; do [ "${OCTET[$other]}" != "$o" ] || die ".$o is $other's address"; done
        mkdir -p "$STATE"
        echo "$h $o" >> "$STATE/extra"
        HOSTS+=("$h")
        OCTET[$h]=$o
    fi
    exists "$SWITCH" || die "the cluster is not up"
    host_up "$h"
    write_hosts
}

del() {   # del HOST: the pod is gone (its processes first, as a kubelet stops containers before the sandbox)
    local ns; ns=$(ns_of "$1")
    rm -rf "/etc/netns/$ns"
    if exists "$ns"; then end_processes "$ns"; ip netns del "$ns"; fi
    ip -n "$SWITCH" link del "v-$1" >/dev/null 2>&1 || true
}

dns() {   # dns NAME HOST|-
    local name=$1 target=$2 a=""
    [[ "$name" =~ ^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$ ]] || die "'$name' is not a DNS name"
    if [ "$target" != - ]; then
        if [[ "$target" =~ ^[0-9]+(\.[0-9]+){3}$ ]]; then a=$target; else a=$(addr_of "$target"); fi
    fi
    mkdir -p "$STATE"
    touch "$STATE/dns"
    { grep -v "^$name " "$STATE/dns" || true; [ -z "$a" ] || echo "$name $a"; } > "$STATE/dns.new"
    mv "$STATE/dns.new" "$STATE/dns"
    write_hosts
}

write_hosts() {   # /etc/netns/<ns>/hosts of every host that exists, from $STATE/dns, rewritten in place
    local h ns f
    [ -f "$STATE/dns" ] || return 0     # no names given: the hosts see the machine's /etc/hosts
    for h in "${HOSTS[@]}"; do
        ns=$(ns_of "$h")
        exists "$ns" || continue
        f="/etc/netns/$ns/hosts"
        mkdir -p "/etc/netns/$ns"
        # `>` truncates and rewrites the same inode: the bind mount of a running process keeps pointing at it
        {
            printf '127.0.0.1\tlocalhost\n%s\t%s\n' "$(addr_of "$h")" "$h"
            awk '{ printf "%s\t%s\n", $2, $1 }' "$STATE/dns"
        } > "$f"
    done
}

counters() {
    local hosts=("$@")
    [ ${#hosts[@]} -gt 0 ] || hosts=("${HOSTS[@]}")
    printf '%-8s %-16s %14s %14s %12s\n' host address rx_bytes tx_bytes lo_bytes
    for h in "${hosts[@]}"; do
        local ns; ns=$(ns_of "$h")
        # /sys inside `ip netns exec` shows that namespace's devices
        ip netns exec "$ns" sh -c 'printf "%s %s %s\n" "$(cat /sys/class/net/eth0/statistics/rx_bytes)" \
            "$(cat /sys/class/net/eth0/statistics/tx_bytes)" "$(cat /sys/class/net/lo/statistics/tx_bytes)"' |
            { read -r rx tx lo; printf '%-8s %-16s %14s %14s %12s\n' "$h" "$(addr_of "$h")" "$rx" "$tx" "$lo"; }
    done
}

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
    up) need; up; echo "netns_cluster: up: $(for h in "${HOSTS[@]}"; do printf '%s=%s ' "$h" "$(addr_of "$h")"; done)" ;;
    down) need; down ;;
    exec)
        need; [ $# -ge 2 ] || die "usage: exec HOST CMD..."
        ns=$(ns_of "$1"); shift; exec ip netns exec "$ns" "$@" ;;
    map)
        printf 'scheduler=%s,server0=%s,server1=%s,worker0=%s,worker1=%s\n' "$(ns_of sched)" "$(ns_of server0)" \
            "$(ns_of server1)" "$(ns_of worker0)" "$(ns_of worker1)" ;;
    addr) [ $# -eq 1 ] || die "usage: addr HOST"; addr_of "$1" ;;
    counters) need; counters "$@" ;;
    link)
        need; [ $# -eq 2 ] && { [ "$2" = up ] || [ "$2" = down ]; } || die "usage: link HOST down|up"
        ip -n "$(ns_of "$1")" link set eth0 "$2" ;;
    add) need; [ $# -eq 2 ] || die "usage: add HOST OCTET"; add "$1" "$2" ;;
    del) need; [ $# -eq 1 ] || die "usage: del HOST"; del "$1" ;;
    dns) need; [ $# -eq 2 ] || die "usage: dns NAME HOST|-"; dns "$1" "$2" ;;
    status)
        need
        for ns in "$SWITCH" $(for h in "${HOSTS[@]}"; do ns_of "$h"; done); do
            if exists "$ns"; then
                echo "$ns: $(ip -n "$ns" -4 -o addr show scope global | awk '{print $2, $4}' | tr '\n' ' ')"
            else
                echo "$ns: absent"
            fi
        done ;;
    *) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; [ -z "$cmd" ] || exit 2 ;;
esac
