"""Every file the project writes and reads back: atomic files (``atomic``), server snapshots, base + deltas
(``snapshots``), the journal (``journal``), MXNet's NDArray files (``ndfile``), checkpoint sidecars (``sidecar``),
and densify / inspect (``densify``). ``checkpoint`` re-exports the names these held before they were split. numpy
only: the server and the worker both use it."""
