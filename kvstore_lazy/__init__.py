"""kvstore-lazy: a drop-in Python parameter server for MXNet 1.9.1 with lazily materialized row_sparse rows.

Layers (imports only point down): ``protocol`` (sans-IO codec) and ``store`` (numpy row tables) import nothing of
the project; ``initializers``, ``optimizers``, ``compression`` are pure numpy; ``server`` (request semantics) uses
those but no zmq; ``transport`` is the only zmq code; ``runtime``/``cli`` wire them together. ``worker`` and
``integration`` run in the training process and are the only modules that import mxnet.
"""
__version__ = "0.1.0"
