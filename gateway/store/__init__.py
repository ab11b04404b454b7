"""The LMDB-backed session store: durable sessions, queues, inbound QoS 2 state and retained messages."""
