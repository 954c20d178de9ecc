"""The launcher's one error type.

Owns: LaunchError, raised for a job that cannot be started as described (a bad option, a hostfile or namespace map
that names no usable host, a restart setting without what it needs); the command line turns it into one usage line.
Does not own: a node's failure once it runs (that is an exit status, judged by ``supervise``).
"""
from __future__ import annotations


class LaunchError(RuntimeError):
    pass
