"""``mypyc_attr``, the class decorator that tells mypyc (setup.py, docs/compiled.md) how to compile a class of the
core, without making ``mypy_extensions`` a dependency of the installed broker.

mypyc reads the decorator from the source when it compiles (by its name, ``mypy_extensions.mypyc_attr``, which
the type checker sees here); at run time the decorator changes nothing, so an install without
``mypy_extensions`` (the pure-Python package on a board) uses the stand-in below, which returns the class as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr as mypyc_attr
else:
    try:
        from mypy_extensions import mypyc_attr
    except ImportError:

        def mypyc_attr(*_attrs: str, **_kwattrs: Any) -> Any:
            return lambda cls: cls
