"""The launcher without MXNet: hostfiles, --env, --netns-map, ssh command lines (quoting checked by running them
through a shell), node environments, and supervision with stand-in processes (a failing or killed node ends the job
with a line naming it, every process group is gone afterwards, Ctrl-C/SIGTERM stop everything, dead servers are
restarted to rejoin)."""
from __future__ import annotations

import functools
import io
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstore_lazy import launch
from kvstore_lazy.launch import (Job, LaunchError, NetnsPlacer, SshPlacement, SshPlacer, build_parser,
                                 job_from_args, parse_env, parse_hostfile, parse_netns_map)

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
FAKE_SSH = [PY, str(ROOT / "tests" / "fake_ssh.py")]


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def stub(code: str) -> list[str]:
    """A stand-in node: python running `code` (it can read its DMLC_* environment)."""
    return [PY, "-c", code]


SLEEP = stub("import time; time.sleep(120)")
# writes its environment to $STUB_DIR/<role><task>.json, then sleeps
RECORD_AND_SLEEP = stub("import json, os, time; "
                        "p = os.path.join(os.environ['STUB_DIR'], os.environ['DMLC_ROLE'] + os.environ['DMLC_TASK_ID']"
                        " + '.' + os.environ.get('KVSTORE_LAZY_RECOVERY', '0') + '.json'); "
                        "open(p + '.tmp', 'w').write(json.dumps(dict(os.environ))); os.replace(p + '.tmp', p); "
                        "print('up', flush=True); time.sleep(120)")


# ----------------------------------------------------------------------------------------------------------------
# parsing


def test_hostfile_forms():
    text = "# cluster\n10.0.0.1\n\n10.0.0.2:2222\nnode3 slots=4\nnode4:23 slots=2  # a comment\n"
    assert parse_hostfile(text) == [("10.0.0.1", "22"), ("10.0.0.2", "2222"), ("node3", "22"), ("node4", "23")]
    with pytest.raises(LaunchError):
        parse_hostfile("# nothing\n\n")
    with pytest.raises(LaunchError):
        parse_hostfile("host:ssh\n")


def test_env_items():
    assert parse_env(["A:1", "B=2,C:x=y", "D"], source={"D": "from here"}) == \
        {"A": "1", "B": "2", "C": "x=y", "D": "from here"}
    with pytest.raises(LaunchError):
        parse_env(["MISSING"], source={})


def test_netns_map():
    m = parse_netns_map("scheduler=a, server=b,server1=c@10.9.9.9;worker=d,worker0=e")
    placer = NetnsPlacer(m)
    placer._addresses = {"a": "10.0.0.1", "b": "10.0.0.2", "d": "10.0.0.4", "e": "10.0.0.5"}
    assert (placer.scheduler().namespace, placer.scheduler().host) == ("a", "10.0.0.1")
    assert (placer.server(0).namespace, placer.server(0).host) == ("b", "10.0.0.2")
    assert (placer.server(1).namespace, placer.server(1).host) == ("c", "10.9.9.9")   # rank entry wins, @address
    assert placer.worker(0).namespace == "e" and placer.worker(1).namespace == "d"
    argv, _ = placer.worker(0).command(["python", "train.py"], {"DMLC_ROLE": "worker"})
    assert argv == ["ip", "netns", "exec", "e", "python", "train.py"]
    for bad in ["scheduler1=x", "server", "gpu=x", "worker0="]:
        with pytest.raises(LaunchError):
            parse_netns_map(bad)
    with pytest.raises(LaunchError, match="worker2"):
        NetnsPlacer(parse_netns_map("scheduler=a,server=b,worker0=c"))._placement("worker", 2)


def test_ssh_placement_follows_mxnet():
    """dmlc ssh.py: node i of (servers, then workers) runs on hosts[i % len(hosts)]."""
    hosts = [("h0", "22"), ("h1", "2222"), ("h2", "22")]
    placer = SshPlacer(hosts, num_servers=2, scheduler_host="10.1.1.1")
    assert [placer.server(r).host for r in range(2)] == ["h0", "h1"]
    assert [placer.worker(r).host for r in range(4)] == ["h2", "h0", "h1", "h2"]
    assert placer.server(1).ssh_port == "2222"
    assert type(placer.scheduler()) is launch.Placement and placer.scheduler().host == "10.1.1.1"
    remote = SshPlacer(hosts, 2, scheduler_host="ignored", remote_scheduler="h1")
    assert isinstance(remote.scheduler(), SshPlacement) and remote.scheduler().host == "h1"
    assert remote.scheduler_host == "h1" and remote.scheduler_port() == launch.DEFAULT_PORT
    sync = placer.sync_commands("/src/dir", "/dst")
    assert [c[-1] for c in sync] == ["h0:/dst", "h1:/dst", "h2:/dst"]
    assert sync[1][:4] == ["rsync", "-az", "--rsh", "ssh -o StrictHostKeyChecking=no -o BatchMode=yes -p 2222"]
    assert sync[0][4] == "/src/dir/"


NASTY = ["it's", 'say "hi"', "$HOME `id` $(id)", "a;b && c | d", "tab\tand\nnewline", "*", "", "--flag=x y"]


def test_ssh_command_line_quotes_everything(tmp_path, monkeypatch):
    """The remote command string, run by a POSIX shell as sshd would, gives the program exactly its arguments and
    environment."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("PS_VERBOSE", "1")
    monkeypatch.setenv("UNRELATED_SECRET", "x")
    placement = SshPlacement("node7", ssh_port="2200", ssh_command=["ssh", "-i", "key file"],
                             workdir=str(tmp_path / "work dir"))
    (tmp_path / "work dir").mkdir()
    out = tmp_path / "out.json"
    program = [PY, "-c", "import json, os, sys; json.dump({'argv': sys.argv[1:], 'cwd': os.getcwd(), "
                         "'env': dict(os.environ)}, open(sys.argv[1], 'w'))", str(out)] + NASTY
    node_env = {"DMLC_ROLE": "worker", "WEIRD": "a b'c\"$d", "EMPTY": ""}
    argv, env = placement.command(program, node_env)
    assert argv[:3] == ["ssh", "-i", "key file"]
    assert "-tt" in argv and argv[argv.index("-p") + 1] == "2200" and argv[-2] == "node7"
    for opt in ("StrictHostKeyChecking=no", "BatchMode=yes", "ServerAliveInterval=5"):
        assert opt in argv
    remote = argv[-1]
    subprocess.run(["sh", "-c", remote], check=True, env={"PATH": os.environ["PATH"]})
    got = json.loads(out.read_text())
    assert got["argv"] == [str(out)] + NASTY
    assert got["cwd"] == str(tmp_path / "work dir")
    assert got["env"]["WEIRD"] == "a b'c\"$d" and got["env"]["EMPTY"] == "" and got["env"]["DMLC_ROLE"] == "worker"
    assert got["env"]["OMP_NUM_THREADS"] == "3" and got["env"]["PS_VERBOSE"] == "1"   # passed like MXNet's launcher
    assert "UNRELATED_SECRET" not in got["env"]


def test_fake_ssh_parses_like_openssh():
    sys.path.insert(0, str(ROOT / "tests"))
    import fake_ssh
    info, host, command = fake_ssh.parse(["-o", "BatchMode=yes", "-tt", "-p", "2200", "-ikey", "user@h1", "echo",
                                          "a b"])
    assert host == "h1" and info["port"] == "2200" and command == "echo a b"
    assert "-tt" in info["options"] and "-i key" in info["options"]


def args_for(*argv: str):
    return build_parser().parse_args(list(argv))


def test_node_environment_and_restart_settings(tmp_path, monkeypatch):
    monkeypatch.delenv("PS_RESEND", raising=False)
    monkeypatch.delenv("PS_RESEND_TIMEOUT", raising=False)
    job = job_from_args(args_for("-n", "2", "-s", "2", "--restart-servers", "1", "--snapshot-dir", str(tmp_path),
                                 "--env", "A:1", "--env-worker", "W:1", "--env-server", "S:1", "python", "t.py"))
    specs = job.node_specs()
    assert [(r, k) for r, k, *_ in specs] == [("scheduler", 0), ("server", 0), ("server", 1), ("worker", 0),
                                             ("worker", 1)]
    ports = set()
    for role, rank, placement, argv, env in specs:
        assert env["DMLC_ROLE"] == role and env["DMLC_TASK_ID"] == str(rank)
        assert env["DMLC_PS_ROOT_URI"] == "127.0.0.1" and env["DMLC_PS_ROOT_PORT"] == str(job.port)
        assert env["DMLC_NUM_WORKER"] == "2" and env["DMLC_NUM_SERVER"] == "2" and env["A"] == "1"
        assert env["PS_RESEND"] == "1" and env["PS_RESEND_TIMEOUT"] == launch.RESEND_TIMEOUT_MS
        if role == "server":
            assert env["KVSTORE_LAZY_JOURNAL"] == "1" and env["KVSTORE_LAZY_SNAPSHOT_DIR"] == str(tmp_path)
            assert env["S"] == "1" and "W" not in env
            ports.add(env["PORT"])
        if role == "worker":
            assert env["W"] == "1" and "S" not in env and "PORT" not in env
    assert len(ports) == 2
    assert job.server_command == launch.LAZY_SERVER and job.scheduler_command == launch.STOCK_NODE

    with pytest.raises(LaunchError, match="snapshot-dir"):
        job_from_args(args_for("-n", "1", "--restart-servers", "1", "python", "t.py"))
    with pytest.raises(LaunchError, match="PS_RESEND"):
        job_from_args(args_for("-n", "1", "--restart-servers", "1", "--snapshot-dir", "x", "--env", "PS_RESEND:0",
                               "python", "t.py"))
    with pytest.raises(LaunchError, match="stock"):
        job_from_args(args_for("-n", "1", "--server", "stock", "--restart-servers", "1", "--snapshot-dir", "x",
                               "python", "t.py"))
    with pytest.raises(LaunchError, match="ssh"):
        job_from_args(args_for("-n", "1", "-H", "hosts", "python", "t.py"))
    with pytest.raises(LaunchError, match="netns-map"):
        job_from_args(args_for("-n", "1", "--launcher", "netns", "python", "t.py"))
    netns = job_from_args(args_for("-n", "1", "--launcher", "netns", "--netns-map", "scheduler=a,server=b,worker=c",
                                   "--restart-servers", "2", "--snapshot-dir", "/s", "python", "t.py"))
    netns.placer._addresses = {"a": "10.0.0.1", "b": "10.0.0.2", "c": "10.0.0.3"}
    specs = netns.node_specs()
    assert specs[0][4]["DMLC_PS_ROOT_URI"] == "10.0.0.1" and specs[0][4]["DMLC_PS_ROOT_PORT"] == "9091"
    assert specs[1][4]["DMLC_NODE_HOST"] == "10.0.0.2" and specs[1][4]["PORT"] == "9200"
    assert specs[2][4]["DMLC_NODE_HOST"] == "10.0.0.3" and specs[2][4]["DMLC_JOB_CLUSTER"] == "netns"


def test_dry_run_prints_commands(capsys):
    assert launch.main(["-n", "1", "-s", "1", "--dry-run", "python", "my script.py"]) == 0
    out = capsys.readouterr().out
    assert "# scheduler 0 on 127.0.0.1" in out and "DMLC_ROLE=server" in out and "'my script.py'" in out


# ----------------------------------------------------------------------------------------------------------------
# supervision with stand-in processes


def stub_job(tmp_path, worker_codes: list[str], **kwargs) -> tuple[Job, io.StringIO]:
    out = io.StringIO()
    kwargs.setdefault("scheduler_command", SLEEP)
    kwargs.setdefault("server_command", SLEEP)
    job = Job(command=stub("import os, sys, time\n" + "\n".join(
        f"if os.environ['DMLC_TASK_ID'] == '{i}':\n    " + code.replace("\n", "\n    ")
        for i, code in enumerate(worker_codes))), num_workers=len(worker_codes), num_servers=kwargs.pop("servers", 1),
        out=out, env={"STUB_DIR": str(tmp_path)}, **kwargs)
    return job, out


def assert_all_gone(job: Job) -> None:
    assert job.history, "nothing was started"
    for node in job.history:
        assert node.popen.poll() is not None, f"{node.name} pid {node.pid} still running"
        assert group_gone(node.pid), f"process group {node.pid} of {node.name} still has members"


def test_failing_worker_ends_the_job_and_names_it(tmp_path):
    job, out = stub_job(tmp_path, ["time.sleep(120)", "print('working', flush=True); time.sleep(0.5); sys.exit(3)"])
    job.start()
    started = time.monotonic()
    code = job.supervise(timeout=60)
    assert code == 3
    assert time.monotonic() - started < 10
    text = out.getvalue()
    assert "[worker 1] working" in text
    assert "ERROR: worker 1 (pid" in text and "exited with status 3; stopping the job" in text
    assert_all_gone(job)


def test_killed_worker_is_detected_at_once(tmp_path):
    job, out = stub_job(tmp_path, ["time.sleep(120)", "time.sleep(120)"])
    job.start()
    time.sleep(0.5)
    victim = next(n for n in job.nodes if n.name == "worker 0")
    killed = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    code = job.supervise(timeout=60)
    ended = time.monotonic()
    assert code == 128 + signal.SIGKILL
    exited = next(t for t, what, name, _ in job.events if what == "exited" and name == "worker 0")
    assert exited - killed < 0.5, "a dead node is noticed within the poll interval"
    assert ended - killed < job.grace + 1
    assert "worker 0 (pid" in out.getvalue() and "was killed by SIGKILL" in out.getvalue()
    assert_all_gone(job)


def test_deadline_reports_a_hang(tmp_path):
    job, out = stub_job(tmp_path, ["time.sleep(120)"])
    job.start()
    assert job.supervise(timeout=1.5) == 124
    assert "deadline of 2s reached; still running: scheduler, server 0, worker 0" in out.getvalue()
    assert_all_gone(job)


def test_dead_server_is_restarted_to_rejoin(tmp_path):
    job, out = stub_job(tmp_path, ["time.sleep(4)"], server_command=RECORD_AND_SLEEP, restart_servers=1,
                        servers=2, finish_grace=1)
    job.start()
    deadline = time.monotonic() + 30
    while not (tmp_path / "server1.0.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    first = json.loads((tmp_path / "server1.0.json").read_text())
    victim = next(n for n in job.nodes if n.name == "server 1")
    os.kill(victim.pid, signal.SIGKILL)
    code = job.supervise(timeout=60)
    assert code == 0   # the workers finished; scheduler and servers (stand-ins) are stopped after finish_grace
    text = out.getvalue()
    assert "server 1 (pid" in text and "restarting it (restart 1 of 1)" in text
    again = json.loads((tmp_path / "server1.1.json").read_text())
    assert again["KVSTORE_LAZY_RECOVERY"] == "1"
    for name in ("PORT", "DMLC_NODE_HOST", "DMLC_PS_ROOT_PORT", "DMLC_TASK_ID"):
        assert again[name] == first[name], name
    assert [name for _, what, name, _ in job.events if what == "restarted"] == ["server 1"]
    assert len(job.history) == 5
    assert_all_gone(job)


def test_server_restarts_are_limited(tmp_path):
    job, out = stub_job(tmp_path, ["time.sleep(120)"], server_command=stub("import sys; sys.exit(7)"),
                        restart_servers=2)
    job.start()
    assert job.supervise(timeout=60) == 7
    assert out.getvalue().count("restarting it") == 2
    assert "ERROR: server 0 (pid" in out.getvalue()
    assert_all_gone(job)


def test_abort_after_the_scheduler_finished_is_a_warning(tmp_path):
    """ps-lite's Resender may abort a node during teardown under PS_RESEND once the final barrier is done (the
    scheduler or a server has exited 0, maybe a moment after the abort): the job still succeeded."""
    job, out = stub_job(tmp_path, ["time.sleep(1); os.abort()", "time.sleep(2)"],
                        scheduler_command=stub("import time; time.sleep(3)"), server_command=stub("import time; "
                                                                                             "time.sleep(2)"))
    job.start()
    assert job.supervise(timeout=60) == 0
    assert "WARNING: worker 0" in out.getvalue() and "SIGABRT" in out.getvalue()
    assert_all_gone(job)
    # without such signs, an abort is a failure (judged after ABORT_JUDGE_WAIT)
    job, out = stub_job(tmp_path, ["time.sleep(0.5); os.abort()"])
    job.start()
    started = time.monotonic()
    assert job.supervise(timeout=60) == 128 + signal.SIGABRT
    assert time.monotonic() - started < launch.ABORT_JUDGE_WAIT + 3
    assert "ERROR: worker 0" in out.getvalue()
    assert_all_gone(job)


def run_cli(tmp_path, extra: list[str], worker: list[str], preexec_fn=None) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "kvstore_lazy.launch", "-n", "2", "-s", "1",
                             "--scheduler-command", shlex.join(SLEEP), "--server-command", shlex.join(SLEEP)]
                            + extra + worker, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=dict(os.environ, STUB_DIR=str(tmp_path),
                                                PYTHONPATH=str(ROOT)), start_new_session=True,
                            preexec_fn=preexec_fn)


def started_pids(line: str) -> list[int]:
    return [int(w.rstrip(",")) for w in line.split("pid ")[1:] for w in [w.split()[0]]]


@pytest.mark.parametrize("inherited", ["default", "ignored"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cli_interrupt_stops_every_process(tmp_path, sig, inherited):
    """Also when the launcher inherits SIGINT ignored, as a background job of a non-interactive shell does."""
    disposition = signal.SIG_IGN if inherited == "ignored" else signal.SIG_DFL
    proc = run_cli(tmp_path, [], SLEEP, preexec_fn=lambda: signal.signal(signal.SIGINT, disposition))
    pids = []
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "started 1 servers and 2 workers" in line:
                break
        pids = started_pids(lines[-1])
        assert len(pids) == 4
        os.kill(proc.pid, sig)
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:   # the test failed: end the launcher and what it started, by PID
            proc.kill()
            proc.communicate(timeout=30)
            for pid in pids:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    assert proc.returncode == 128 + sig
    assert f"interrupted ({signal.Signals(sig).name}); stopping every process" in rest
    for pid in pids:
        assert group_gone(pid)


def test_cli_reports_the_failed_node_and_status(tmp_path):
    proc = run_cli(tmp_path, ["--timeout", "60"],
                   stub("import os, sys, time\nif os.environ['DMLC_TASK_ID'] == '1': sys.exit(5)\ntime.sleep(60)"))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 5, out
    assert "ERROR: worker 1 (pid" in out and "exited with status 5" in out and "job finished with status 5" in out
    pids = started_pids(next(line for line in out.splitlines() if "started 1 servers" in line))
    for pid in pids:
        assert group_gone(pid)


def test_ssh_launcher_runs_nodes_through_ssh(tmp_path):
    """--launcher ssh with a stand-in ssh that runs the remote command here: servers first, then workers, on the
    hostfile's hosts; each node gets DMLC_NODE_HOST of its host and the DMLC_* of the job."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("127.0.0.1\nlocalhost:2222\n")
    log = tmp_path / "ssh.log"
    env = dict(os.environ, STUB_DIR=str(tmp_path), FAKE_SSH_LOG=str(log), PYTHONPATH=str(ROOT))
    proc = subprocess.run([PY, "-m", "kvstore_lazy.launch", "--launcher", "ssh", "-H", str(hostfile), "-n", "2",
                           "-s", "2", "--host", "127.0.0.1", "--ssh-command", shlex.join(FAKE_SSH),
                           "--scheduler-command", shlex.join(SLEEP), "--server-command", shlex.join(RECORD_AND_SLEEP),
                           "--env", "STUB_DIR", "--timeout", "60"]
                          + stub("import json, os; p = os.path.join(os.environ['STUB_DIR'], 'worker' + "
                                 "os.environ['DMLC_TASK_ID'] + '.0.json'); open(p, 'w').write(json.dumps("
                                 "dict(os.environ)))"),
                          cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    placed = {}
    for c in calls:   # the stand-in ssh processes log in whatever order they start
        words = dict(w.split("=", 1) for w in shlex.split(c["command"]) if w.startswith("DMLC_"))
        placed[words["DMLC_ROLE"] + words["DMLC_TASK_ID"]] = (c["host"], c["port"])
    assert placed == {"server0": ("127.0.0.1", "22"), "server1": ("localhost", "2222"),
                      "worker0": ("127.0.0.1", "22"), "worker1": ("localhost", "2222")}
    assert all("-tt" in c["options"] and c["command"].startswith(f"cd {ROOT} && exec env ") for c in calls)
    nodes = {name: json.loads((tmp_path / f"{name}.0.json").read_text())
             for name in ("server0", "server1", "worker0", "worker1")}
    assert nodes["server0"]["DMLC_NODE_HOST"] == "127.0.0.1" and nodes["server1"]["DMLC_NODE_HOST"] == "localhost"
    assert nodes["worker0"]["DMLC_NODE_HOST"] == "127.0.0.1" and nodes["worker1"]["DMLC_NODE_HOST"] == "localhost"
    assert {n["DMLC_PS_ROOT_URI"] for n in nodes.values()} == {"127.0.0.1"}
    assert {n["DMLC_JOB_CLUSTER"] for n in nodes.values()} == {"ssh"}
    assert "started 2 servers and 2 workers" in proc.stdout


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux setpriv (--pdeathsig)")
def test_nodes_die_with_a_killed_launcher(tmp_path):
    """Even kill -9 of the launcher leaves nothing behind: every node gets SIGTERM when its parent dies."""
    proc = run_cli(tmp_path, [], SLEEP)
    for line in proc.stdout:
        if "started 1 servers and 2 workers" in line:
            break
    pids = started_pids(line)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    proc.stdout.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(group_gone(pid) for pid in pids):
        time.sleep(0.05)
    assert all(group_gone(pid) for pid in pids)


def test_scripts_launch_is_the_same_launcher():
    out = subprocess.run([PY, str(ROOT / "scripts" / "launch.py"), "-n", "1", "--dry-run", "python", "t.py"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "# worker 0 on 127.0.0.1" in out.stdout


# ----------------------------------------------------------------------------------------------------------------
# output prefixes: start order and ps-lite's ranks


def test_pslite_rank_order_is_the_schedulers_comparator():
    """van.cc sorts with ``(a.hostname.compare(b.hostname) | (a.port < b.port)) > 0``; written out literally here
    (compare() may return any negative or positive int) against random addresses, ties and all."""
    def comparator(a, b):
        cmp = (a[0].encode() > b[0].encode()) - (a[0].encode() < b[0].encode())
        cmp *= 1 + a[0].count("1")                       # any magnitude: only the sign survives the "| bool"
        before = (cmp | (a[1] < b[1])) > 0
        after = ((-cmp) | (b[1] < a[1])) > 0
        return -1 if before else (1 if after else 0)

    rng = random.Random(5)
    hosts = ["10.0.0.4", "10.0.0.5", "10.0.0.10", "127.0.0.1", "host-a", "host-b"]
    for _ in range(200):
        addresses = list({(rng.choice(hosts), rng.randrange(1024, 1100)) for _ in range(rng.randrange(1, 9))})
        rng.shuffle(addresses)
        ordered = sorted(addresses, key=functools.cmp_to_key(comparator))
        assert launch.pslite_rank_order(addresses) == [ordered.index(a) for a in addresses]
    assert launch.pslite_rank_order([("127.0.0.1", 5000), ("127.0.0.1", 4000), ("127.0.0.1", 4500)]) == [2, 0, 1]
    assert launch.pslite_rank_order([("10.0.0.4", 1), ("10.0.0.5", 9), ("10.0.0.10", 5), ("10.0.0.5", 2)]) == \
        [2, 1, 3, 0]


def test_listening_ports_of_a_process_and_its_children(tmp_path):
    listen = ("import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
              "print(s.getsockname()[1], flush=True); time.sleep(60)")
    # a shell that runs the listener as a child (`; true` keeps sh from exec-ing it)
    proc = subprocess.Popen(["sh", "-c", f'{shlex.quote(PY)} -c {shlex.quote(listen)}; true'], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    idle = subprocess.Popen(SLEEP, start_new_session=True)
    try:
        port = int(proc.stdout.readline())
        assert launch.listening_ports(proc.pid) == {port}
        assert launch.listening_ports(idle.pid) == set()
    finally:
        for p in (proc, idle):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        proc.stdout.close()
    assert launch.listening_ports(idle.pid) is None                # gone


def test_ranks_from_ports_need_one_listener_per_node(tmp_path):
    """Stand-in workers: the one listening on one port each get ranks by port; a node with two listeners makes the
    role's ranks unknowable from ports (said once), and its prefixes stay the start-order names."""
    listen = ("import socket; socks = [socket.socket() for _ in range({n})]\n"
              "for s in socks: s.bind(('127.0.0.1', 0)); s.listen()\n"
              "time.sleep(1.5); print('port', socks[0].getsockname()[1], flush=True); time.sleep(0.5)")
    job, out = stub_job(tmp_path, [listen.format(n=1), listen.format(n=1)], finish_grace=0.5)
    job.start()
    assert job.supervise(timeout=60) == 0
    said = {int(line.rsplit(" ", 1)[1]): line.split("] ", 1)[0] for line in out.getvalue().splitlines()
            if "] port " in line}
    assert [said[port][-len(", rank 0"):] for port in sorted(said)] == [", rank 0", ", rank 1"], said
    job, out = stub_job(tmp_path, [listen.format(n=1), listen.format(n=2)], finish_grace=0.5)
    job.start()
    assert job.supervise(timeout=60) == 0
    text = out.getvalue()
    assert text.count("listens on 2 ports") == 1 and "worker ranks are not inferred from ports" in text
    assert "[worker 0] port" in text and "[worker 1] port" in text and ", rank" not in text


@pytest.mark.integration
def test_prefixes_carry_the_ranks_ps_lite_gave(tmp_path):
    """Ports in reverse start order (PORT per DMLC_TASK_ID), so ps-lite ranks server 0 and worker 0 last: every
    line of a node says its start-order name and its rank, and the rank agrees with what the node itself says."""
    pytest.importorskip("mxnet")
    ports = sorted({launch.free_port() for _ in range(6)})[:4]

    def reversed_ports(low: int, high: int, argv: list[str]) -> list[str]:
        return ["sh", "-c", f'if [ "$DMLC_TASK_ID" = 0 ]; then export PORT={high}; else export PORT={low}; fi; '
                            f'exec "$@"', "node"] + argv
    worker = [PY, "-c", "import mxnet as mx, time; kv = mx.kv.create('dist_sync'); "
                        "print('worker says rank', kv.rank, flush=True); kv._barrier()"]
    out = io.StringIO()
    job = Job(command=reversed_ports(ports[0], ports[1], worker), num_workers=2, num_servers=2, out=out,
              server_command=reversed_ports(ports[2], ports[3], launch.LAZY_SERVER), env={"OMP_NUM_THREADS": "1"})
    job.start()
    assert job.supervise(timeout=120) == 0, out.getvalue()
    text = out.getvalue()
    for index, rank in ((0, 1), (1, 0)):
        assert f"[server {index}, rank {rank}] " in text and f"[worker {index}, rank {rank}] " in text
    lines = [line for line in text.splitlines() if "registered as server rank" in line or "worker says rank" in line]
    assert len(lines) == 4
    for line in lines:
        prefix, rest = line.split("] ", 1)
        told = re.search(r"(?:registered as server|worker says) rank (\d+)", rest).group(1)
        assert prefix.endswith(f", rank {told}"), line
    assert "ps-lite numbers nodes by address, not start order" in text and "worker 0 is rank 1" in text
    assert_all_gone(job)
