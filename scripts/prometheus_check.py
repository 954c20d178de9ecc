"""Does every panel of the Grafana dashboard return data from a real Prometheus scraping a real job?

Owns: the opt-in end-to-end check of docker/grafana/kvstore-lazy.json (`make check-dashboard`, not part of
`make test`). It installs Debian's ``prometheus`` if it is not on PATH (apt-get, with services kept from starting),
runs a small real job on 127.0.0.1 (the stock scheduler, two kvstore_lazy servers with metrics, a memory budget,
a disk tier and periodic snapshots, two stock workers running tests/workers/metrics_job.py), has Prometheus scrape
both servers every second, evaluates each panel's queries through Prometheus' HTTP API and prints which return
data. Exit status 0 only if every panel does. Does not own the metrics (kvstore_lazy.node.promexport) or the names
a panel may use (tests/test_dashboard.py checks those without Prometheus).

The workers are started only once Prometheus has scraped both servers, so the rate() panels see the training, not
only its end. Every process gets a deadline and is ended by its PID.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from cluster import Job, free_port  # noqa: E402

DASHBOARD = ROOT / "docker" / "grafana" / "kvstore-lazy.json"
# what Grafana puts in for the dashboard's variables (every job and server; a rate window of several scrapes)
VARIABLES = {"$job": ".+", "$instance": ".+", "$__rate_interval": "1m"}
SERVER_ENV = {"KVSTORE_LAZY_METRICS_PORT": "0", "KVSTORE_LAZY_METRICS_BIND": "127.0.0.1",
              "KVSTORE_LAZY_SNAPSHOT_INTERVAL": "2", "KVSTORE_LAZY_MEMORY_BUDGET": "16KiB",
              "KVSTORE_LAZY_STATS_INTERVAL": "3600"}
# few rows, many steps: the budget moves rows to disk and the pulls bring them back
WORKER_ARGS = ["--steps", "40", "--rows", "2000"]
POLICY_RC = Path("/usr/sbin/policy-rc.d")


def ensure_prometheus() -> str:
    """The prometheus binary; installed from Debian's package if missing (its service is not started)."""
    found = shutil.which("prometheus")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        sys.exit("prometheus is not installed and apt-get cannot install it here (needs root on Debian)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    made_policy = not POLICY_RC.exists()
    if made_policy:   # invoke-rc.d asks this script; 101: do not start the package's service
        POLICY_RC.write_text("#!/bin/sh\nexit 101\n")
        POLICY_RC.chmod(0o755)
    try:
        install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "prometheus"]
        if subprocess.run(install, env=env, timeout=600).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], env=env, timeout=600, check=True)
            subprocess.run(install, env=env, timeout=600, check=True)
    finally:
        if made_policy:
            POLICY_RC.unlink()
    return shutil.which("prometheus") or "/usr/bin/prometheus"


def wait_until(what: str, check, timeout: float, job: Job | None = None):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise SystemExit(f"{what}: not within {timeout:.0f}s" + ("\n" + job.report() if job else ""))
        time.sleep(0.2)


def metrics_ports(job: Job) -> list[int]:
    ports = []
    for proc in job.procs:
        if proc.name.startswith("server"):
            found = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", proc.output())
            if not found:
                return []
            ports.append(int(found.group(1)))
    return ports


def api(port: int, path: str, **params) -> dict:
    url = f"http://127.0.0.1:{port}/api/v1/{path}" + ("?" + urllib.parse.urlencode(params) if params else "")
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read().decode())


def start_prometheus(binary: str, tmp: Path, targets: list[int]) -> tuple[subprocess.Popen, int]:
    config = tmp / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n"
                      "  - job_name: kvstore-lazy\n    static_configs:\n      - targets: ["
                      + ", ".join(f"'127.0.0.1:{p}'" for p in targets) + "]\n")
    port = free_port()
    with open(tmp / "prometheus.log", "wb") as log:
        proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, port


def scraped_both(port: int, count: int) -> bool:
    try:
        active = api(port, "targets")["data"]["activeTargets"]
    except OSError:
        return False
    return len(active) == count and all(t["health"] == "up" for t in active)


def evaluate(port: int) -> list[tuple[str, str, int]]:
    """(panel title, query, series returned with a number) for every query of every panel."""
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in (p for p in board["panels"] if p["type"] != "row"):
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            result = api(port, "query", query=expr)["data"]["result"]
            numbers = [r for r in result if not math.isnan(float(r["value"][1]))]
            out.append((panel["title"], target["expr"], len(numbers)))
    return out


def run_job(binary: str, tmp: Path) -> list[tuple[str, str, int]]:
    job = Job(tmp, num_workers=2, num_servers=2, server="lazy", mode_env={"MXNET_KVSTORE_BIGARRAY_BOUND": "1000"})
    prometheus = None
    try:
        job.start(server_env=dict(SERVER_ENV, KVSTORE_LAZY_SNAPSHOT_DIR=str(tmp / "snap"),
                                  KVSTORE_LAZY_DISK_DIR=str(tmp / "disk")))
        ports = wait_until("the servers' metrics ports in their logs", lambda: metrics_ports(job), 60, job)
        prometheus, prom_port = start_prometheus(binary, tmp, ports)
        wait_until("Prometheus scraping both servers", lambda: scraped_both(prom_port, len(ports)), 60)
        out = str(tmp / "res")
        job.spawn_workers("metrics_job.py", ["--out", out, "--hold", "120"] + WORKER_ARGS)
        wait_until("the workers' end of training", lambda: Path(out + ".ready").exists(), 240, job)
        time.sleep(8)    # a few more scrapes and periodic snapshots
        results = evaluate(prom_port)
        Path(out + ".go").touch()
        job.wait(120)
        return results
    finally:
        job.kill()
        if prometheus is not None:
            prometheus.terminate()
            try:
                prometheus.wait(timeout=20)
            except subprocess.TimeoutExpired:
                prometheus.kill()
                prometheus.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the job's directory (logs, Prometheus' data)")
    args = parser.parse_args(argv)
    binary = ensure_prometheus()
    print("prometheus:", subprocess.run([binary, "--version"], capture_output=True, text=True,
                                        timeout=30).stdout.splitlines()[0])
    tmp = Path(tempfile.mkdtemp(prefix="kvstore-lazy-dashboard-"))
    try:
        results = run_job(binary, tmp)
    finally:
        if args.keep:
            print("kept", tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    width = max(len(title) for title, _, _ in results)
    for title, expr, series in results:
        print(f"{'ok  ' if series else 'NONE'} {title:<{width}} {series:3d} series  {expr}")
    empty = sorted({title for title, _, series in results if not series})
    answered = sum(1 for _, _, series in results if series)
    print(f"{answered} of {len(results)} queries returned data; panels without data: {', '.join(empty) or 'none'}")
    return 1 if empty else 0


if __name__ == "__main__":
    sys.exit(main())
