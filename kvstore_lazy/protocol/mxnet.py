"""MXNet 1.9.1's use of ps-lite: request types x dtypes in the data head, SimpleApp command heads, server key ranges
and how the worker splits keys over servers (src/kvstore/kvstore_dist.h, kvstore_dist_server.h).

Owns: pure arithmetic on these encodings. No I/O, no mxnet import.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvstore_lazy.protocol.errors import ProtocolError

# enum class RequestType
DEFAULT, ROW_SPARSE, COMPRESSED = 0, 1, 2
REQUEST_NAMES = {DEFAULT: "default", ROW_SPARSE: "row_sparse", COMPRESSED: "compressed"}

# enum class CommandType (SimpleApp heads)
CONTROLLER, SET_MULTI_PRECISION, STOP_SERVER, SYNC_MODE, SET_GRADIENT_COMPRESSION, SET_PROFILER_PARAMS = range(6)
# kvstore_lazy's own SimpleApp heads; stock servers answer unknown heads and ignore them.
LAZY_DECLARE, LAZY_STATS, LAZY_ROWS, LAZY_SNAPSHOT = 100, 101, 102, 103

# Virtual row_sparse keys through which a stock worker reads what rows exist (see kvstore_lazy.worker.fetch_rows and
# server/state_transfer.py). A pull of ROWS_HEADER_KEY (float64, ROWS_WIDTH wide, rows_part(S) rows per server)
# answers, per server: local row 0 = protocol.kv.RowsHeader, local row r >= 1 = the row ids r-1 * ROWS_WIDTH ...
# (float64, exact below 2**53; padded with -1).
ROWS_HEADER_KEY = 1 << 30
ROWS_WIDTH = 64
MAX_STATES = 8


def rows_part(num_servers: int) -> int:
    """Rows of ROWS_HEADER_KEY per server: as many as a stock worker can allocate (an NDArray of the whole virtual
    shape must stay below 2**31 elements without USE_INT64_TENSOR_SIZE)."""
    return (2 ** 31 - 2) // (ROWS_WIDTH * num_servers)


def is_virtual_key(key: int) -> bool:
    return key >= ROWS_HEADER_KEY


# kvstore_lazy.worker.integration (the mxnet patches): string-key KVStores reach the virtual keys through string keys
# whose
# ints (MXNet numbers string keys in init order) a LAZY_ALIAS command ({"alias": int, "key": virtual key}) names;
# LAZY_SET_COUNTS ({"key": K, "counts": [per server], "num_update": [per server]}) restores optimizer update counts.
LAZY_ALIAS, LAZY_SET_COUNTS = 110, 111
# A pull of FLAT_STATE_BASE + j (float32, ROWS_WIDTH wide, rows_part(S) rows per server) answers, per server, optimizer
# state j of the key a LAZY_ROWS command named, flattened (a row_sparse key: its listed rows in order; a dense key:
# this server's part) and cut into rows of ROWS_WIDTH (the last one zero-padded). A push of the same rows writes the
# state back; a push of ROWS_HEADER_KEY rows (row 0 = [count], then the ids) first names the rows it is for.
FLAT_STATE_BASE = ROWS_HEADER_KEY + 8


def flat_state_key(state: int) -> int:
    if not 0 <= state < MAX_STATES:
        raise ValueError(f"optimizer state {state} outside [0, {MAX_STATES})")
    return FLAT_STATE_BASE + state


def is_flat_state_key(key: int) -> bool:
    return FLAT_STATE_BASE <= key < FLAT_STATE_BASE + MAX_STATES

# mshadow type flags -> numpy dtypes (only the types MXNet's server switch admits, MSHADOW_REAL_TYPE_SWITCH,
# plus the integer ones a default push may carry).
MSHADOW_DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<f4"), 1: np.dtype("<f8"), 2: np.dtype("<f2"), 3: np.dtype("u1"), 4: np.dtype("<i4"),
    5: np.dtype("i1"), 6: np.dtype("<i8"),
}
DTYPE_FLAGS = {dt: flag for flag, dt in MSHADOW_DTYPES.items()}
FLOAT32 = 0
KMAX_KEY = (1 << 64) - 1


def command_code(request_type: int, dtype_flag: int) -> int:
    """MXNet's GetCommandType: the Cantor pairing of (request type, mshadow dtype)."""
    s = request_type + dtype_flag
    return s * (s + 1) // 2 + dtype_flag


@dataclass(frozen=True)
class DataCommand:
    request_type: int
    dtype_flag: int

    @property
    def dtype(self) -> np.dtype:
        return MSHADOW_DTYPES[self.dtype_flag]


def decode_command(code: int) -> DataCommand:
    """Invert command_code; unknown request types or dtypes raise ProtocolError."""
    if code < 0:
        raise ProtocolError(f"negative data command {code}")
    w = (math.isqrt(8 * code + 1) - 1) // 2
    dtype_flag = code - w * (w + 1) // 2
    request_type = w - dtype_flag
    if request_type not in REQUEST_NAMES:
        raise ProtocolError(f"data command {code}: unknown request type {request_type}")
    if dtype_flag not in MSHADOW_DTYPES:
        raise ProtocolError(f"data command {code}: unsupported dtype flag {dtype_flag}")
    return DataCommand(request_type, dtype_flag)


def server_key_begin(rank: int, num_servers: int) -> int:
    """First key of server `rank`'s range (Postoffice::GetServerKeyRanges)."""
    return (KMAX_KEY // num_servers) * rank


def server_key_end(rank: int, num_servers: int) -> int:
    return (KMAX_KEY // num_servers) * (rank + 1)


def c_round(x: float) -> int:
    """C's round()/llround(): half away from zero (Python's round() is half to even).

    Exact for every double: ``floor(x + 0.5)`` is not, since the addition itself rounds (0.49999999999999994 + 0.5
    is 1.0, and odd integers above 2**52 plus 0.5 round up to the next even one)."""
    a = abs(x)
    whole = math.floor(a)
    if a - whole >= 0.5:  # a - floor(a) is exact in binary floating point
        whole += 1
    return int(whole) if x >= 0 else -int(whole)


def dense_partition(num_elements: int, num_servers: int, server: int) -> tuple[int, int]:
    """(offset, size) in elements of a big dense array's part on `server` (EncodeDefaultKey)."""
    # static_cast<double>(num_arr_elems) / num_servers * i, in double arithmetic like the C++ (a Python int / int
    # would divide exactly before rounding, which differs once num_elements exceeds 2**53)
    start = c_round(float(num_elements) / num_servers * server)
    end = c_round(float(num_elements) / num_servers * (server + 1))
    return start, end - start


def row_partition(total_rows: int, num_servers: int, server: int) -> tuple[int, int]:
    """(first global row, number of rows) of a partitioned row_sparse key's part on `server` (EncodeRowSparseKey
    uses llround, which is also half away from zero)."""
    start = c_round(float(total_rows) / num_servers * server)
    end = c_round(float(total_rows) / num_servers * (server + 1))
    return start, end - start


def is_partitioned(num_elements: int, bigarray_bound: int) -> bool:
    return num_elements >= bigarray_bound


def dense_home_server(key: int, num_servers: int) -> int:
    """The server of an unpartitioned key: ``(key * 9973) % S`` computed in C int (wraps for key > 215326)."""
    product = (key * 9973) & 0xFFFFFFFF
    if product & 0x80000000:
        product -= 1 << 32
    # C++ % truncates toward zero; a negative product gives a negative index, which MXNet never hits in practice.
    return int(math.fmod(product, num_servers))
