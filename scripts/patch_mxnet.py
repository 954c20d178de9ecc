#!/usr/bin/env python3
"""``make patch`` / ``make unpatch``: a checkout's spelling of ``kvstore-lazy patch`` (kvstore_lazy/worker/patch.py,
which owns the tool; the diffs stay in the checkout's top-level patches/).

    python scripts/patch_mxnet.py apply  [--target DIR]   # `make patch`   (kvstore-lazy patch)
    python scripts/patch_mxnet.py revert [--target DIR]   # `make unpatch` (kvstore-lazy patch --revert)
    python scripts/patch_mxnet.py status [--target DIR]   #                (kvstore-lazy patch --check: 0 if patched)

Exit status: 0 done / nothing to do, 1 refused, 2 usage.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvstore_lazy.worker.patch import *  # noqa: E402,F401,F403  (tests read ORIGINALS, PATCH_DIR, parse_diff...)
from kvstore_lazy.worker.patch import script_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(script_main())
