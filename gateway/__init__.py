"""edge-gateway: an MQTT 3.1.1 + 5.0 edge broker with durable sessions."""

__version__ = "0.1.0"

# Before any module of gateway/mqtt is imported: the compiled codec or its .py files (gateway/native.py).
from gateway import native as _native

_native.select()
