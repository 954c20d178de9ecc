"""Server durability and recovery: the journal format, the resume gate, and (integration, on 127.0.0.1) a server
killed with kill -9 mid-training that rejoins from its snapshot and journal, and a whole job restarted from its
last tagged snapshot. Both must end bit for bit where an undisturbed run ends (no update lost or applied twice).
The same scenarios run across network-namespace hosts in tests/test_cluster.py."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvstore_lazy.persist import snapshots
from kvstore_lazy.persist import journal
from kvstore_lazy.node import membership
from kvstore_lazy.protocol import mxnet as mx
from kvstore_lazy.protocol.message import KVPairs, Message
from kvstore_lazy.protocol.pbmeta import Meta
from kvstore_lazy.node.runtime import (Config, Outbox, StartupError, find_membership, membership_path,
                                  _rejoin_timestamp)
from kvstore_lazy.server.core import KVServer
from kvstore_lazy.server.resume import ResumeGate

import faultjob


# ----------------------------------------------------------------------------------------------------------------
# journal


def test_journal_round_trip_torn_tail_and_reopen(tmp_path):
    path = journal.journal_path(tmp_path, 1, epoch=0xABC, base_seq=7)
    assert path.name == "journal.rank1.0000000000000abc.7"
    j = journal.Journal.create(path, 0xABC, 7, seen=[11, 12], pending=[(9, [b"meta", b"", b"data"])])
    assert j.append(9, [b"m1", b"k" * 8, b"v" * 100]) == 8
    j.ack(555)
    j.ack(556)
    assert j.append(11, [b"m2"]) == 9
    j.ack(557)
    j.close()
    c = journal.read(path)
    assert (c.epoch, c.base_seq, c.seen, c.pending) == (0xABC, 7, [11, 12], [(9, [b"meta", b"", b"data"])])
    assert [(e.seq, e.sender, e.frames) for e in c.entries] == [(8, 9, [b"m1", b"k" * 8, b"v" * 100]),
                                                               (9, 11, [b"m2"])]
    assert c.acked == {555, 556, 557} and c.torn_bytes == 0
    # a record cut short by a crash is ignored, and cut off when appending goes on
    size = path.stat().st_size
    j = journal.Journal.create(path, 1, 0)
    j.append(9, [b"a" * 50])
    j.append(9, [b"b" * 50])
    j.close()
    full = path.stat().st_size
    os.truncate(path, full - 10)
    c = journal.read(path)
    assert [e.frames for e in c.entries] == [[b"a" * 50]] and c.torn_bytes > 0
    j = journal.Journal.reopen(path, c)
    assert j.append(9, [b"c"]) == 2
    j.close()
    assert [e.frames for e in journal.read(path).entries] == [[b"a" * 50], [b"c"]]
    assert size > 0


def test_journal_rejects_foreign_files_and_cleans_up(tmp_path):
    bad = tmp_path / "journal.rank0.x.0"
    bad.write_bytes(b"NOPE" + b"\0" * 40)
    with pytest.raises(journal.JournalError):
        journal.read(bad)
    assert journal.read(tmp_path / "missing") is None
    keep = journal.journal_path(tmp_path, 0, 5, 10)
    journal.Journal.create(keep, 5, 10).close()
    journal.Journal.create(journal.journal_path(tmp_path, 0, 5, 3), 5, 3).close()
    journal.Journal.create(journal.journal_path(tmp_path, 1, 5, 3), 5, 3).close()
    journal.remove_others(tmp_path, 0, keep)
    assert sorted(p.name for p in tmp_path.glob("journal.*")) == [keep.name, "journal.rank1.0000000000000005.3"]


# ----------------------------------------------------------------------------------------------------------------
# runtime pieces


def _push(sender: int, key: int, values: np.ndarray, ts: int) -> Message:
    kv = KVPairs(np.array([key], np.uint64), values.astype(np.float32).tobytes(),
                 np.array([values.size * 4], np.int32))
    data, types = kv.frames()
    meta = Meta(head=mx.command_code(mx.DEFAULT, mx.FLOAT32), app_id=0, customer_id=0, timestamp=ts, request=True,
                push=True, data_type=types)
    return Message(meta, data, sender=sender)


def _command(sender: int, head: int, body: bytes, ts: int) -> Message:
    return Message(Meta(head=head, body=body, app_id=0, customer_id=0, timestamp=ts, request=True, simple_app=True),
                   sender=sender)


def test_resume_gate_drops_the_init_push_and_the_same_optimizer():
    server = KVServer(0, 1, 2)
    w0, w1 = membership.worker_id(0), membership.worker_id(1)
    server.handle(_push(w0, 4, np.arange(3.0), 0))                       # a restored dense key
    gate = ResumeGate([4], optimizer_body=b"OPT")
    same = gate.intercept(server.key_range, _command(w1, mx.CONTROLLER, b"OPT", 1))
    assert same is not None and same[0][0] == w1 and same[0][1].meta.simple_app and not same[0][1].meta.request
    assert gate.intercept(server.key_range, _command(w1, mx.CONTROLLER, b"OTHER", 2)) is None
    assert gate.intercept(server.key_range, _push(w1, 4, np.ones(3), 3)) is None   # not rank 0: a gradient
    assert not gate.optimizer_skip                                       # training began: optimizers apply again
    # rank 0's kv.init of the restored key
    replies = gate.intercept(server.key_range, _push(w0, 4, np.full(3, 9.0), 4))
    assert replies is not None and replies[0][1].meta.push and replies[0][1].meta.timestamp == 4
    assert gate.intercept(server.key_range, _push(w0, 4, np.ones(3), 5)) is None   # only the first one
    assert not gate.active
    state = ResumeGate([4, 7], b"OPT").state()
    assert ResumeGate.from_state(state, b"OPT").state() == state == {"await_init": [4, 7], "optimizer_skip": True}


def test_outbox_resends_until_acked():
    box = Outbox(timeout=1.0)
    msg = Message(Meta(timestamp=3))
    box.track(42, 9, msg, now=0.0)
    assert box.due(0.5) == []
    assert [e[0] for e in box.due(1.1)] == [9]
    assert box.due(1.5) == [] and [e[4] for e in box.due(2.2)] == [2]
    assert box.ack(42) and not box.ack(42) and box.pending == {}


def test_membership_records_and_rejoin_timestamps(tmp_path):
    for rank, port in ((0, 9200), (1, 9201)):
        membership_path(tmp_path, rank).write_text(json.dumps(
            {"rank": rank, "host": "10.0.0.2", "port": port + 5, "requested_port": port}))
    assert find_membership(tmp_path, "10.0.0.2", 9201)["rank"] == 1            # by requested PORT
    assert find_membership(tmp_path, "10.0.0.2", 9205)["rank"] == 0            # by the port it bound
    assert find_membership(tmp_path, "x", 0, rank=1)["rank"] == 1              # KVSTORE_LAZY_RECOVER_RANK
    with pytest.raises(StartupError, match="known: rank 0 at 10.0.0.2:9205"):
        find_membership(tmp_path, "10.0.0.3", 9200)
    ts = _rejoin_timestamp()
    assert (1 << 29) <= ts < (1 << 30)     # apart from a first process's counter, and below ps-lite's int shift


def test_recovery_config_needs_a_journal():
    base = {"DMLC_ROLE": "server", "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": "9", "DMLC_NUM_WORKER": "1",
            "DMLC_NUM_SERVER": "1", "DMLC_NODE_HOST": "127.0.0.1"}
    with pytest.raises(StartupError, match="KVSTORE_LAZY_SNAPSHOT_DIR"):
        Config.from_env(dict(base, KVSTORE_LAZY_RECOVERY="1"))
    with pytest.raises(StartupError, match="KVSTORE_LAZY_JOURNAL"):
        Config.from_env(dict(base, KVSTORE_LAZY_RECOVERY="1", KVSTORE_LAZY_SNAPSHOT_DIR="/s"))
    cfg = Config.from_env(dict(base, KVSTORE_LAZY_RECOVERY="1", KVSTORE_LAZY_SNAPSHOT_DIR="/s",
                               KVSTORE_LAZY_JOURNAL="1", PS_RESEND="1", PS_RESEND_TIMEOUT="2500"))
    assert cfg.recovery == "rejoin" and cfg.journal and cfg.resend and cfg.resend_timeout == 2.5
    assert Config.from_env(dict(base, KVSTORE_LAZY_RECOVERY="register", KVSTORE_LAZY_SNAPSHOT_DIR="/s",
                                KVSTORE_LAZY_JOURNAL="1")).recovery == "register"
    with pytest.raises(StartupError):
        Config.from_env(dict(base, KVSTORE_LAZY_RESUME="sometimes"))
    # ps-lite reads PS_RESEND with atoi: "true" is off for stock nodes, so it is off here too
    assert [Config.from_env(dict(base, PS_RESEND=v)).resend for v in ("1", "2", "0", "true", "", "10x")] == \
        [True, True, False, False, False, True]


# ----------------------------------------------------------------------------------------------------------------
# integration: real jobs on 127.0.0.1


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    outcome = faultjob.run(faultjob.make_job(out), out)
    assert outcome.code == 0, outcome.log[-5000:]
    assert faultjob.updates_lost(out) == 0
    return faultjob.final(out)


@pytest.mark.integration
def test_killed_server_rejoins_and_nothing_is_lost(tmp_path, reference):
    """kill -9 of a server under continuous traffic (no pause between steps), a moment after a step: requests die
    in its socket buffers and rounds are half-done; the workers' PS_RESEND and the journal make up for all of it."""
    out = tmp_path / "run"
    outcome = faultjob.run(faultjob.make_job(out, sleep=0.0), out, fault=faultjob.kill("server 1", delay=0.03),
                           at_step=25)
    log = outcome.log
    assert outcome.code == 0, log[-6000:]
    assert "server 1 (pid" in log and "was killed by SIGKILL; restarting it" in log
    assert "recovered rank" in log and "journaled requests replayed" in log
    assert faultjob.same_model(faultjob.final(out), reference), "the model differs from an undisturbed run"
    assert faultjob.updates_lost(out) == 0
    assert outcome.event("restarted", "server 1") - outcome.fault_mono < 1.0
    assert outcome.recovered_after(outcome.fault_wall) < 30
    assert faultjob.processes_left(outcome.job) == []


@pytest.mark.integration
def test_whole_job_restarts_from_its_last_checkpoint(tmp_path, reference):
    out = tmp_path / "run"
    first = faultjob.run(faultjob.make_job(out, checkpoint_every=10), out, fault=faultjob.kill("worker 1"),
                         at_step=25)
    assert first.code == 128 + 9, first.log[-4000:]
    assert faultjob.processes_left(first.job) == []
    tag = snapshots.common_tag(out / "snap", 2)
    assert tag["step"] in (20, 30) and tag["step"] <= first.fault_step
    second = faultjob.run(faultjob.make_job(out, resume=True, checkpoint_every=10, log_name="job2.log"), out)
    assert second.code == 0, second.log[-6000:]
    assert "worker 0: resuming after step" in second.log and "kv.init push from worker 0 is dropped" in second.log
    assert "keeping its states and counts" in second.log
    assert faultjob.same_model(faultjob.final(out), reference)
    assert faultjob.updates_lost(out) == 0
    assert faultjob.processes_left(second.job) == []
