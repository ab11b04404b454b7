"""Sans-I/O MQTT 3.1.1 + 5.0 codec: bytes in, packets out. Pure stdlib; no sockets, no clocks.

Its modules run compiled by mypyc or as these .py files; which one is chosen here, before any of them is imported
(gateway/native.py, docs/compiled.md). This file itself is never compiled.
"""

from gateway import native as _native

_native.select()
