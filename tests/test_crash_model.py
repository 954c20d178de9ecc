"""Power loss: every write not made durable by an fsync is dropped, and the server still recovers a committed state.

The cycle of ``test_crash_points`` runs under the tracer with a ``crashtrace.Durable``: each fsync records what it
made durable (by inode). The crash state at a point is the file system's names as they stand (metadata persists in
order, as ext4's and XFS's journals give it) with every file's data as of its last fsync, a file never fsynced
empty: the pessimistic state ALICE and CrashMonkey build for a power cut. From each, a fresh server must recover to
the model the undisturbed run had after some requests, and to none that was not committed:

- with ``KVSTORE_LAZY_JOURNAL_FSYNC=1`` nothing journaled is lost (each record is fsynced before it is ACKed);
- without it, at worst the state of the last snapshot that committed (records after it were in no fsync), never a
  torn or half-written file read as state.

A sample by default (as ``test_crash_points``); ``KVSTORE_LAZY_CRASH_POINTS=all`` recovers from every point.
"""
from __future__ import annotations

import pytest

import crashtrace
from test_crash_points import chosen, enumerate_crashes, judge


@pytest.mark.parametrize("journal_fsync", [True, False], ids=["journal-fsync", "no-journal-fsync"])
def test_a_power_cut_at_any_point_recovers_a_committed_state(tmp_path, journal_fsync):
    durable = crashtrace.Durable()
    cycle, points, results = enumerate_crashes(tmp_path, durable, journal_fsync)
    assert len({p.index for p, when, *_ in results if when == "before"}) == sum(map(chosen, points))
    assert durable.data, "no fsync was recorded"
    failures = judge(cycle, results, lossless=journal_fsync)
    print(f"{len(points)} points, {len(results)} power-loss states recovered, {len(failures)} failed")
    assert not failures, f"{len(failures)} of {len(results)} crash states failed:\n" + "\n".join(failures[:40])
