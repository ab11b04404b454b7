"""Pseudo-terminals standing in for serial cables in the simulators (:mod:`firmware_bridge.simulator`,
:mod:`firmware_bridge.modbus_sim`): a raw pty pair, and a symlink kept pointing at the bridge's end, as
udev keeps ``/dev/serial/by-id/...`` pointing at a USB adapter's current ``/dev/ttyUSBn``."""

from __future__ import annotations

import contextlib
import os
import tty
from pathlib import Path


def open_raw_pty() -> tuple[int, int, str]:
    """A new pty pair in raw mode (bytes pass unchanged, like a UART), the master non-blocking.

    Returns ``(master_fd, slave_fd, slave_path)``. Raises OSError when no pty can be had."""
    master, slave = os.openpty()
    tty.setraw(slave)
    os.set_blocking(master, False)
    return master, slave, os.ttyname(slave)


def point_link(link: Path, target: str) -> None:
    """Atomically make ``link`` a symlink to ``target`` (a new one beside it, then ``os.replace``)."""
    tmp = link.with_name(link.name + ".new")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(target)
    os.replace(tmp, link)
