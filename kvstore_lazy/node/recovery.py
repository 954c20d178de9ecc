"""How a server comes back: its membership record, and the choice between a fresh start, a rejoin and ps-lite's
own recovery (KVSTORE_LAZY_RECOVERY).

Owns: the membership record ``node.rank<r>.json`` in the snapshot directory (what a rejoining server needs to know
about the job it was in: its id, rank, address, peers, and whether the job finished), finding the record of this
host:port (or of KVSTORE_LAZY_RECOVER_RANK), checking that it belongs to this job, the choice of
KVSTORE_LAZY_RECOVERY=auto (``placement.rejoin_decision``), and the first timestamp of a restarted server.
Also owns: what a server removes at start before it reads anything (:func:`remove_leftovers`): an interrupted base
swap finished (its new version had committed), and the temp files and directories of writes a dead process never
finished, so that none is ever mistaken for committed state or left to fill the disk.
Does not own: the rejoin itself (``session``), restoring the state (``durability``) or the record's age rules
(``placement``).
"""
from __future__ import annotations

import dataclasses

import json
import logging
import os
from pathlib import Path
from typing import Any

from kvstore_lazy import paths
from kvstore_lazy.node import placement
from kvstore_lazy.node.errors import StartupError
from kvstore_lazy.persist import checkpoint, snapshots
from kvstore_lazy.persist.atomic import remove_path

log = logging.getLogger("kvstore_lazy")

FRESH, REJOIN, REGISTER, AUTO = "", "rejoin", "register", "auto"   # the values of Config.recovery


def membership_path(directory: str | os.PathLike, rank: int) -> Path:
    return paths.membership(directory, rank)


def find_membership(directory: str | os.PathLike, host: str, port: int, rank: int = -1,
                    missing_ok: bool = False) -> dict | None:
    """The record of the server that ran at host:port (its requested or bound port), or of `rank` (None if there
    is none and `missing_ok`)."""
    records = []
    for path in sorted(Path(directory).glob("node.rank*.json")):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as exc:
            log.warning("ignoring %s: %s", path, exc)
    if rank >= 0:
        found = [r for r in records if r.get("rank") == rank]
    else:
        found = [r for r in records if r.get("host") == host and port and port in (r.get("port"),
                                                                                     r.get("requested_port"))]
    if not found and missing_ok:
        return None
    if len(found) != 1:
        known = ", ".join(f"rank {r.get('rank')} at {r.get('host')}:{r.get('port')}" for r in records) or "none"
        want = f"rank {rank}" if rank >= 0 else f"{host}:{port}"
        raise StartupError(f"cannot rejoin as {want}: {len(found)} matching records in {directory} (known: {known}). "
                           f"Restart the server with the DMLC_NODE_HOST and PORT it had, or set "
                           f"KVSTORE_LAZY_RECOVER_RANK")
    return found[0]


def rejoin_record(cfg) -> dict:
    """KVSTORE_LAZY_RECOVERY=1: the record of the server this one takes over from, checked to be of this job."""
    record = find_membership(cfg.snapshot_dir, cfg.host, cfg.port, cfg.recover_rank)
    assert record is not None
    for name, mine in (("root_uri", cfg.root_uri), ("root_port", cfg.root_port),
                       ("num_servers", cfg.num_servers), ("num_workers", cfg.num_workers)):
        if record.get(name) != mine:
            raise StartupError(f"cannot rejoin: the record {membership_path(cfg.snapshot_dir, record['rank'])} "
                               f"has {name}={record.get(name)!r}, this process {mine!r} (another job?)")
    return record


def decide(cfg):
    """KVSTORE_LAZY_RECOVERY=auto (a pod or container restarted with the same environment): rejoin the job of
    this host:port's previous process if it died within the rejoin window, else register (placement): the
    Config with the recovery decided."""
    record = find_membership(cfg.snapshot_dir, cfg.host, cfg.port, cfg.recover_rank, missing_ok=True)
    path = membership_path(cfg.snapshot_dir, record["rank"]) if record is not None else None
    rejoin, why = placement.rejoin_decision(record, path, cfg.rejoin_window)
    log.info("KVSTORE_LAZY_RECOVERY=auto: %s", why)
    return dataclasses.replace(cfg, recovery=REJOIN if rejoin else FRESH, is_recovery=rejoin)


def write_record(cfg, rank: int, my_id: int, port: int, peers: list, state: str = "running") -> None:
    """This server's record (``state`` "running", or "finished" past the final barrier: a later start with this
    record registers anew)."""
    record = {"rank": rank, "id": my_id, "host": cfg.host, "port": port, "state": state,
              "requested_port": cfg.port, "root_uri": cfg.root_uri, "root_port": cfg.root_port,
              "num_servers": cfg.num_servers, "num_workers": cfg.num_workers, "pid": os.getpid(),
              "peers": [[p.node_id, p.role, p.hostname, p.port] for p in peers]}
    def write(fh: Any) -> None:
        fh.write(json.dumps(record, indent=1))
    checkpoint.atomic_write(membership_path(cfg.snapshot_dir, rank), write, mode="w")


def rejoin_timestamp(wall: float) -> int:
    """The first control-message timestamp of a restarted server. PS_RESEND peers drop a message whose signature
    (sender, timestamp, ...) they saw before, so a restarted server must not count from 0 again: it starts at
    2^29 + (wall-clock ms mod 2^28), far above what the first process used (one heartbeat a second) and apart from
    any other restart's range, and below 2^30 (ps-lite shifts the timestamp left once in an int).
    `wall` is the wall clock in seconds (time.time())."""
    return (1 << 29) + int(wall * 1000) % (1 << 28)


def remove_leftovers(snapshot_dir: str | os.PathLike, rank: int, disk_dir: str | os.PathLike = "") -> list[Path]:
    """At start, before anything of `rank` is read: its snapshots settled (``snapshots.settle``: an interrupted
    base swap finished, temp directories of bases and deltas removed), the temp files of its journal's headers and
    of its membership record removed, and those of its disk tier stores in `disk_dir` (``store.json.tmp``,
    ``index.npz.tmp``: the store itself is rebuilt from the snapshot). Returns what it settled or removed."""
    done = snapshots.settle(snapshot_dir, rank)
    found = paths.leftovers(paths.membership(snapshot_dir, rank))
    found += [p for p in paths.journals(snapshot_dir, rank) if p.name.endswith(paths.TEMP_SUFFIX)]
    if disk_dir:
        found += sorted((Path(disk_dir) / f"rank{rank}").glob(f"key*/*{paths.TEMP_SUFFIX}"))
    for path in found:
        remove_path(path)
    done += found
    if done:
        log.info("removed what interrupted writes left for rank %d: %s", rank, ", ".join(str(p) for p in done))
    return done
