"""Numerics as pure, vectorised functions over rows: initializers keyed by (seed, key, row id), optimizers as MXNet
computes them, and 2-bit gradient compression. numpy and the compiled kernels only; no I/O."""
