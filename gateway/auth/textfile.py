"""Reading the operator's text files (password file, ACL file) with errors that name the file and the line."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


class FileLineError(ValueError):
    """A file that cannot be read or parsed; ``str()`` is ``"<path>:<line>: <reason>"`` (``"<path>: <reason>"``
    for line 0: the whole file)."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        self.path = path
        self.line = line
        self.reason = reason
        super().__init__(f"{path}:{line}: {reason}" if line else f"{path}: {reason}")


def read_text(path: str | os.PathLike[str], error: Callable[[str, int, str], Exception]) -> tuple[str, str]:
    """``(name, text)`` of the UTF-8 file at ``path``.

    Raises:
        the exception ``error(name, line, reason)`` builds: line 0 when the file cannot be read, else the line (from
        1) of the first byte that is not UTF-8.
    """
    name = os.fspath(path)
    try:
        data = Path(name).read_bytes()
    except OSError as exc:
        raise error(name, 0, f"cannot read: {exc.strerror or exc}") from None
    try:
        return name, data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(name, data[: exc.start].count(b"\n") + 1, "not UTF-8") from None
