"""``python -m kvstore_lazy <command>``: the same as the ``kvstore-lazy`` console script (kvstore_lazy.cli)."""
from kvstore_lazy.cli import main

raise SystemExit(main())
