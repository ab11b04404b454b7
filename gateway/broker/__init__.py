"""Pure broker logic: routing, sessions, registry. No sockets, no clocks (``now`` is passed in).

Its modules run compiled by mypyc or as these .py files; which one is chosen here (or in gateway/mqtt/__init__.py,
whichever is imported first), before any of them is imported (gateway/native.py, docs/compiled.md). This file itself
is never compiled.
"""

from gateway import native as _native

_native.select()
