"""The names this module held before it was split, for the code that still imports them from here (the node, the
worker, some tests): new code imports from the module that owns each name. Runs as
``python -m kvstore_lazy.persist.checkpoint densify IN OUT`` (and ``inspect PATH``), as it always has.

Owns nothing. Where each part went: atomic files -> ``persist.atomic``; server snapshots, base and deltas, tagged
snapshots -> ``persist.snapshots``; checkpoint sidecars and lazy rows -> ``persist.sidecar``; densify, inspect and
their command line -> ``persist.densify``. ``atomic_path`` and ``atomic_write`` keep their old signatures here (a
``lazy`` argument, written as a sidecar): they are ``sidecar.checkpoint_path`` and ``sidecar.write_checkpoint``.
"""
from __future__ import annotations

import sys

from kvstore_lazy.persist.atomic import atomic_write_dir, file_digest
from kvstore_lazy.persist.densify import (CHUNK_ROWS, CHUNK_VALUES, densify, inspect, main, read_row_ids_file)
from kvstore_lazy.persist.sidecar import (SIDECAR_FORMAT, SIDECAR_SUFFIX, CheckpointError, lazy_params, lazy_rows,
                                          lazy_spec, sidecar_path)
from kvstore_lazy.persist.sidecar import checkpoint_path as atomic_path
from kvstore_lazy.persist.sidecar import write_checkpoint as atomic_write
from kvstore_lazy.persist.snapshots import (DEFAULT_MAX_DELTAS, DELTA_FORMAT, FORMAT, TAGGED_DIR, Loaded,
                                            SnapshotChain, SnapshotError, common_tag, delta_path, load_snapshot,
                                            read_manifest, read_snapshot_key, read_tags, write_snapshot)

_file_digest = file_digest

__all__ = [
    "CHUNK_ROWS", "CHUNK_VALUES", "DEFAULT_MAX_DELTAS", "DELTA_FORMAT", "FORMAT", "SIDECAR_FORMAT", "SIDECAR_SUFFIX",
    "TAGGED_DIR", "CheckpointError", "Loaded", "SnapshotChain", "SnapshotError", "atomic_path", "atomic_write",
    "atomic_write_dir", "common_tag", "delta_path", "densify", "file_digest", "inspect", "lazy_params", "lazy_rows",
    "lazy_spec", "load_snapshot", "main", "read_manifest", "read_row_ids_file", "read_snapshot_key", "read_tags",
    "sidecar_path", "write_snapshot",
]

if __name__ == "__main__":
    sys.exit(main())
