"""kvstore-lazy: a drop-in Python parameter server for MXNet 1.9.1 with lazily materialized row_sparse rows.

Rooms, by who runs them (imports only point down; tests/test_layers.py keeps it so):
``protocol`` (sans-IO codec) and ``store`` (row tables, the disk tier) import nothing of the project above them;
``numerics`` (initializers, optimizers, compression) are pure numpy; ``server`` (request semantics) uses those but
no zmq; ``persist`` writes and reads every file; ``transport`` is the only zmq code; ``node`` is the server process
that wires transport and server together; ``worker`` runs in the training process (the only code that imports
mxnet); ``launch`` starts whole jobs.
"""
__version__ = "0.1.0"
