"""The only code that imports zmq: see :mod:`kvstore_lazy.transport.zmq_van`."""
