"""Sans-IO ps-lite protocol: the PBMeta codec, message framing and MXNet's command and key encodings.

Nothing in this package opens a socket, starts a thread or reads a clock; it turns bytes into values and back.
Bad bytes from a peer raise :class:`ProtocolError` and nothing else.
"""
from kvstore_lazy.protocol.errors import ProtocolError

__all__ = ["ProtocolError"]
