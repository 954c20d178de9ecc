"""``python -m kvstore_lazy.launch``: the launcher's command line."""
from kvstore_lazy.launch import main

raise SystemExit(main())
