"""Pure broker logic: routing, sessions, registry. No sockets, no clocks (``now`` is passed in)."""
