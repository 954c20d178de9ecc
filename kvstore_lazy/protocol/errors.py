"""The one error type the protocol layer raises for bad bytes from a peer."""


class ProtocolError(ValueError):
    """A peer sent bytes that are not a valid ps-lite message."""
