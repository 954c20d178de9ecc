#!/usr/bin/env python3
"""``scripts/launch.py``: the same as ``python -m kvstore_lazy.launch`` (MXNet's tools/launch.py options, on
Python 3.11, with kvstore_lazy servers, supervision and server restarts). See ``--help``."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvstore_lazy.launch import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
