"""asyncio glue: listeners, the protocol adapter, the ticker, the runner and config loading.

The protocol adapter (``protocol``) runs compiled by mypyc with the core, or as the .py file; which one is chosen
here, before it is imported (gateway/native.py, docs/compiled.md). This file itself is never compiled.
"""

from gateway import native as _native

_native.select()
