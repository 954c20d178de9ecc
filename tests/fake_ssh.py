#!/usr/bin/env python3
"""A stand-in for ``ssh`` in tests (``--ssh-command "python tests/fake_ssh.py"``).

It reads its command line as OpenSSH does (options, then the host, then the remote command words joined by spaces)
and runs the remote command with ``sh -c`` on this machine: inside the network namespace that holds the host's
address if there is one (so a hostfile of scripts/netns_cluster.sh addresses behaves like real hosts), else here.
It execs, so the process the launcher started is the remote command itself. With FAKE_SSH_LOG set, each call is
appended to that file as one JSON line ({"host", "port", "options", "command", "netns"}).
"""
import json
import os
import subprocess
import sys

# OpenSSH options that take an argument (ssh(1) SYNOPSIS)
WITH_ARG = set("BbcDEeFIiJLlmOoPpQRSWw")


def parse(argv: list[str]) -> tuple[dict, str, str]:
    options, port, i = [], "22", 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        arg = argv[i]
        letter = arg[1:2]
        if letter in WITH_ARG:
            value = arg[2:] or argv[i + 1]
            i += 1 if arg[2:] else 2
            if letter == "p":
                port = value
            options.append(f"-{letter} {value}")
        else:
            options.append(arg)
            i += 1
    if i < len(argv) and argv[i] == "--":
        i += 1
    if i >= len(argv):
        sys.exit("fake_ssh: no host")
    host = argv[i].split("@")[-1]
    return {"options": options, "port": port}, host, " ".join(argv[i + 1:])


def namespace_of(host: str) -> str | None:
    try:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in names.splitlines():
        ns = line.split()[0] if line.split() else ""
        if not ns:
            continue
        addrs = subprocess.run(["ip", "-n", ns, "-4", "-o", "addr", "show"], capture_output=True, text=True,
                               timeout=10).stdout
        if f" {host}/" in addrs:
            return ns
    return None


def main() -> None:
    info, host, command = parse(sys.argv[1:])
    if not command:
        sys.exit("fake_ssh: no remote command (interactive sessions are not supported)")
    ns = None if host in ("localhost", "127.0.0.1") else namespace_of(host)
    if os.environ.get("FAKE_SSH_LOG"):
        with open(os.environ["FAKE_SSH_LOG"], "a") as fh:
            fh.write(json.dumps(dict(info, host=host, command=command, netns=ns)) + "\n")
    argv = ["sh", "-c", command]
    if ns:
        argv = ["ip", "netns", "exec", ns] + argv
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
