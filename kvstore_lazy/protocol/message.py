"""ps-lite messages as frames: identity parsing, meta + data frames, and the KV data payload (keys/vals/lens).

Owns: :class:`Message`, turning ZeroMQ multipart frames into one and back, and splitting the data frames of a
KV request into typed numpy arrays.
Does not own: sockets (``transport``) or what a request means (``server``).

A ROUTER socket sees ``[identity, meta, data0, data1, ...]``; the identity is the sender DEALER's ``ZMQ_IDENTITY``,
``"ps" + decimal(node id)``. Anything else (ZMQ's auto identity included) is sender kEmpty, which the scheduler
uses to tell a new registration (ps-lite ``ZMQVan::GetNodeID``).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore_lazy.protocol.errors import ProtocolError
from kvstore_lazy.protocol.pbmeta import DT_INT32, DT_OTHER, DT_UINT64, EMPTY, Meta, decode_meta, encode_meta


MAX_ID_DIGITS = len(str(EMPTY))   # a node id is an int32 below kEmpty: at most 10 digits


@functools.lru_cache(maxsize=4096)   # a job has a few dozen identities; every message names one
def parse_identity(identity: bytes) -> int:
    """Node id of a ROUTER identity frame: ``ps`` followed by the canonical decimal of an id below kEmpty (what
    ps-lite's ``"ps" + std::to_string(id)`` produces), else EMPTY.

    Stricter than ps-lite's ``ZMQVan::GetNodeID``, which reads any run of ASCII digits: there ``ps01`` and ``ps1``
    are both the scheduler, so a peer could pass for the scheduler or any worker under another spelling. Here
    leading zeros (``ps01``, ``ps00``), signs, spaces, non-ASCII digits, more than 10 digits and ids >= kEmpty
    all mean "no identity".
    """
    digits = identity[2:]
    if identity[:2] != b"ps" or not 0 < len(digits) <= MAX_ID_DIGITS or not digits.isdigit():
        return EMPTY   # bytes.isdigit() is ASCII-only
    if digits[:1] == b"0" and len(digits) > 1:
        return EMPTY
    node_id = int(digits)
    return node_id if node_id < EMPTY else EMPTY


def identity_of(node_id: int) -> bytes:
    """The DEALER identity of node `node_id`, an int32 >= 0 (``ps2147483647``, kEmpty, reads back as no id)."""
    if not 0 <= node_id <= EMPTY:
        raise ValueError(f"node id {node_id} is outside 0..{EMPTY}")
    return b"ps%d" % node_id


@dataclass
class Message:
    meta: Meta
    data: Sequence[bytes | memoryview] = field(default_factory=list)   # large received frames stay memoryviews
    sender: int = EMPTY

    def to_frames(self) -> list[bytes | memoryview]:
        """Frames for a DEALER send: meta first, then the data frames. ``meta.data_type`` must already list one
        type per data frame (ValueError otherwise); KVPairs.frames() returns both."""
        if len(self.meta.data_type) != len(self.data):
            raise ValueError("data_type must list one type per data frame")
        return [encode_meta(self.meta)] + [bytes(d) if not isinstance(d, (bytes, memoryview)) else d
                                           for d in self.data]

    @classmethod
    def from_frames(cls, frames: list) -> "Message":
        """Parse ``[identity, meta, data...]`` as a ROUTER receives it."""
        if len(frames) < 2:
            raise ProtocolError(f"a message needs an identity and a meta frame, got {len(frames)} frame(s)")
        identity = frames[0]
        sender = parse_identity(identity if type(identity) is bytes else bytes(identity))
        meta = decode_meta(frames[1])  # decode_meta takes any buffer, as bytes(frames[1]) did
        data = frames[2:]              # (the transport's frames are bytes and memoryviews already)
        for f in data:
            if type(f) is not bytes and type(f) is not memoryview:
                data = [f if isinstance(f, bytes) else memoryview(f) for f in data]
                break
        return cls(meta, data, sender)


@dataclass
class KVPairs:
    """The data of a KV request or response: ``keys`` (uint64), ``vals`` (raw bytes), ``lens`` (int32, may be empty)."""

    keys: np.ndarray
    vals: bytes | memoryview      # a memoryview of a large received frame (no copy)
    lens: np.ndarray

    def frames(self) -> tuple[list[bytes], list[int]]:
        """Data frames and their data_type codes as KVServer::Response/KVWorker::Send lay them out."""
        if len(self.keys) == 0:
            return [], []
        data = [self.keys.astype("<u8", copy=False).tobytes(), bytes(self.vals)]
        types = [DT_UINT64, DT_OTHER]
        if len(self.lens):
            data.append(self.lens.astype("<i4", copy=False).tobytes())
            types.append(DT_INT32)
        return data, types


_UINT64, _INT32 = np.dtype("<u8"), np.dtype("<i4")   # dtype objects: a dtype string is parsed on every use
_NO_LENS = np.frombuffer(b"", _INT32)                # read-only, like the lens of a received message


def decode_kv(data: Sequence[bytes | memoryview]) -> KVPairs:
    """Split a KV message's data frames (ps-lite KVServer::Process checks) into typed arrays."""
    if not data:
        return KVPairs(np.zeros(0, np.uint64), b"", np.zeros(0, np.int32))
    if len(data) not in (2, 3):
        raise ProtocolError(f"a KV message has 2 or 3 data frames, got {len(data)}")
    raw_keys, vals = bytes(data[0]), data[1]
    if len(raw_keys) % 8:
        raise ProtocolError(f"keys frame of {len(raw_keys)} bytes is not a whole number of uint64")
    keys = np.frombuffer(raw_keys, _UINT64)
    lens = _NO_LENS
    if len(data) == 3:
        raw_lens = bytes(data[2])
        if len(raw_lens) % 4:
            raise ProtocolError(f"lens frame of {len(raw_lens)} bytes is not a whole number of int32")
        lens = np.frombuffer(raw_lens, _INT32)
        if len(lens) != len(keys):
            raise ProtocolError(f"{len(lens)} lens for {len(keys)} keys")
    return KVPairs(keys, vals, lens)
