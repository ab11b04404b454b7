"""The LMDB-backed session store: durable sessions, queues, inbound QoS 2 state and retained messages.

Its row encodings (``records``) run compiled by mypyc with the codec and the broker core, or as the .py file;
which one is chosen here, before any of them is imported (gateway/native.py, docs/compiled.md). This file itself
is never compiled.
"""

from gateway import native as _native

_native.select()
