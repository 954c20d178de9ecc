"""Every file the project writes and reads back: atomic files, server snapshots (base + deltas), the journal,
MXNet's NDArray files, checkpoint sidecars and densify. numpy only: the server and the worker both use it."""
