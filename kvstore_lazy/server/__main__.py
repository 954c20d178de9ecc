"""``python -m kvstore_lazy.server``: a drop-in for ``DMLC_ROLE=server python -c "import mxnet"``."""
from kvstore_lazy.cli import server_main

raise SystemExit(server_main())
