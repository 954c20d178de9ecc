"""Server-side storage for parameter values; ``rows`` holds the lazily created rows of ``row_sparse`` keys."""
