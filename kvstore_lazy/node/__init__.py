"""The server process: the node that owns the transport, the clock and the timers, its membership in a ps-lite
job, who may send what, where it runs, durability of its state, and its metrics. It wires ``transport`` and
``server`` (the sans-IO request semantics) together; nothing below it imports it."""
