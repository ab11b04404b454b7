"""A fake sensor board on a real pseudo-terminal, replaying a real sensor series.

The series is the NERACOOS buoy B01 (Western Maine Shelf) sea-surface temperature record that PyPI's
``bokeh-sampledata`` ships as ``sea_surface_temperature.csv.gz`` (half-hourly, 2016-02-15 to 2017-03-22, 19,226
rows; "free to use and redistribute"). Install it without its pandas/numpy dependencies::

    pip install --no-deps bokeh-sampledata

:class:`SensorBoard` speaks PROTOCOL.md on the master side of ``os.openpty()``: frames with ``seq``/``boot``
as real firmware would, command replies, and faults on demand (garbage bytes, CRC errors, over-long lines,
unplug/replug, reboot). The bridge opens the slave side (or a symlink to it, like ``/dev/serial/by-id``).
"""

from __future__ import annotations

import contextlib
import csv
import errno
import gzip
import io
import logging
import os
import select
import threading
import time
from pathlib import Path
from typing import Any

from firmware_bridge.frames import (
    Command,
    FrameDecoder,
    parse_time,
    reading_frame,
    reply_frame,
)
from firmware_bridge.ptys import open_raw_pty, point_link

log = logging.getLogger("firmware_bridge.simulator")
SERIES_FILE = "sea_surface_temperature.csv.gz"
QUANTITY = "sea_surface_temperature"
UNIT = "degC"
FIRMWARE = "sim-buoy 1.0"

_series_cache: list[tuple[str, float]] | None = None


def series_path() -> Path:
    """Where bokeh-sampledata keeps the B01 file (RuntimeError with the install command if it is missing)."""
    try:
        from bokeh_sampledata import package_path
    except ImportError:
        raise RuntimeError(
            "the B01 series comes from PyPI's bokeh-sampledata: pip install --no-deps bokeh-sampledata"
        ) from None
    path = Path(package_path(SERIES_FILE))
    if not path.exists():
        raise RuntimeError(f"bokeh-sampledata has no {SERIES_FILE} (looked at {path})")
    return path


def load_b01_series() -> list[tuple[str, float]]:
    """The buoy B01 sea-surface temperature series: ``[(RFC 3339 time, degC), ...]`` in time order."""
    global _series_cache
    if _series_cache is None:
        with gzip.open(series_path(), "rt", newline="") as f:
            rows = csv.reader(io.StringIO(f.read()))
            header = next(rows)
            if header[:2] != ["time (UTC)", "temperature (celsius)"]:
                raise RuntimeError(f"unexpected columns in {SERIES_FILE}: {header}")
            series = []
            for stamp, temp in rows:
                series.append((parse_time(stamp) or stamp, float(temp)))
        _series_cache = series
    return _series_cache


class SensorBoard:
    """One simulated board. Thread-safe writes; a reader thread answers commands while plugged in.

    Args:
        device: the device id in its frames.
        link: optional symlink kept pointing at the current pty slave (removed while unplugged).
        boot: the boot counter of the first boot.
        start: index of the first row of the series to replay.
    """

    def __init__(
        self,
        device: str = "buoy-b01",
        link: str | os.PathLike[str] | None = None,
        boot: int = 1,
        start: int = 0,
        series: list[tuple[str, float]] | None = None,
    ) -> None:
        self.device = device
        self.link = Path(link) if link is not None else None
        self.boot = boot
        self.seq = 0
        self.index = start
        self.series = series if series is not None else load_b01_series()
        self.interval = 1.0  # seconds between readings when run() drives the board; set_interval changes it
        self.answer_commands = True
        self.commands: list[Command] = []
        self.path: str | None = None
        self._master: int | None = None
        self._slave: int | None = None
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1
        self._decoder = FrameDecoder()
        self.dropped_bytes = 0
        self.reboot_requested = threading.Event()

    # -- the cable -----------------------------------------------------------------------------------------------

    @property
    def plugged(self) -> bool:
        return self._master is not None

    def plug(self) -> str:
        """Open a new pty (raw mode, like a UART) and point ``link`` at it; returns the slave's path."""
        if self._master is not None:
            return self.path or ""
        self._master, self._slave, self.path = open_raw_pty()
        self._decoder = FrameDecoder()
        if self.link is not None:
            point_link(self.link, self.path)
        self._wake_r, self._wake_w = os.pipe()
        self._reader = threading.Thread(target=self._read_loop, name=f"board-{self.device}", daemon=True)
        self._reader.start()
        return self.path

    def unplug(self) -> None:
        """Pull the cable: remove the link, close the pty (the reader of the slave gets EIO/hang-up)."""
        if self._master is None:
            return
        if self.link is not None:
            with contextlib.suppress(FileNotFoundError):
                self.link.unlink()
        os.write(self._wake_w, b"x")
        if self._reader is not None:
            self._reader.join(5)
        with self._lock:
            for fd in (self._master, self._slave, self._wake_r, self._wake_w):
                if fd is not None and fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._master = self._slave = None
            self._wake_r = self._wake_w = -1
        self._reader = None

    def close(self) -> None:
        self.unplug()

    def __enter__(self) -> SensorBoard:
        self.plug()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what goes on the wire -----------------------------------------------------------------------------------

    def write(self, data: bytes, timeout: float = 2.0) -> int:
        """Write raw bytes to the line; returns how many went out (a UART nobody reads drops the rest)."""
        sent = 0
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._master is None:
                self.dropped_bytes += len(data)
                return 0
            view = memoryview(data)
            while sent < len(data):
                try:
                    sent += os.write(self._master, view[sent:])
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    select.select([], [self._master], [], min(left, 0.05))
                except OSError as exc:
                    if exc.errno in (errno.EIO, errno.EBADF):
                        break
                    raise
        self.dropped_bytes += len(data) - sent
        return sent

    def next_frame(self) -> tuple[int, bytes]:
        """The next reading's frame (advances seq and the series); returns ``(seq, frame)``."""
        stamp, temp = self.series[self.index % len(self.series)]
        seq = self.seq
        frame = reading_frame(self.device, self.boot, seq, {QUANTITY: (temp, UNIT)}, stamp)
        self.seq += 1
        self.index += 1
        return seq, frame

    def send_reading(self) -> int:
        """Send one reading; returns its seq."""
        seq, frame = self.next_frame()
        self.write(frame)
        return seq

    def send_bad_crc(self) -> int:
        """Send the next reading with a wrong CRC (as line noise would leave it); returns the seq it used up."""
        seq, frame = self.next_frame()
        crc = int(frame[-5:-1], 16)
        self.write(frame[:-5] + b"%04X\n" % (crc ^ 0x5A5A))
        return seq

    def send_garbage(self, data: bytes = b"\x00\xff\xfe garbage \x1b[2J\x81\x82\n") -> None:
        self.write(data)

    def send_too_long(self, length: int = 2000) -> None:
        self.write(b"{" + b"x" * length + b"}*0000\n")

    def reboot(self) -> None:
        """A firmware restart: the boot counter goes up, seq starts again at 0."""
        self.boot += 1
        self.seq = 0

    # -- commands ------------------------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        master, wake = self._master, self._wake_r
        assert master is not None
        while True:
            try:
                ready, _, _ = select.select([master, wake], [], [], 1.0)
            except (OSError, ValueError):
                return
            if wake in ready:
                return
            if master not in ready:
                continue
            try:
                data = os.read(master, 4096)
            except BlockingIOError:
                continue
            except OSError:
                return
            if not data:
                return
            for event in self._decoder.feed(data):
                if isinstance(event, Command) and event.device == self.device:
                    self.commands.append(event)
                    if self.answer_commands:
                        self._answer(event)

    def _answer(self, cmd: Command) -> None:
        ok, error = True, None
        data: dict[str, Any] | None = None
        if cmd.cmd == "ping":
            data = {"pong": True}
        elif cmd.cmd == "info":
            data = {"firmware": FIRMWARE, "boot": self.boot, "seq": self.seq, "interval_s": self.interval}
        elif cmd.cmd == "set_interval":
            seconds = cmd.args.get("seconds")
            if isinstance(seconds, int | float) and not isinstance(seconds, bool) and 0.01 <= seconds <= 86400:
                self.interval = float(seconds)
                data = {"interval_s": self.interval}
            else:
                ok, error = False, "bad_args"
        elif cmd.cmd == "reboot":
            data = {"rebooting": True}
        else:
            ok, error = False, "unknown_command"
        self.write(reply_frame(self.device, self.boot, cmd.id, ok, data, error))
        if cmd.cmd == "reboot" and ok:
            self.reboot()
            self.reboot_requested.set()


def run(
    device: str,
    link: str | None,
    rate: float,
    boot: int,
    start: int,
    count: int,
    faults: dict[str, float],
    unplug_every: float,
    reboot_every: float,
    seed: int | None,
    stop: threading.Event,
) -> int:
    """``firmware-bridge simulate``: play the board until ``stop`` (or ``count`` readings); prints the pty path.

    ``faults`` gives per-reading probabilities: ``garbage`` (a line of binary noise before the reading),
    ``bad_crc`` (the reading goes out with a wrong CRC), ``too_long`` (an over-long line before the reading).
    """
    import random

    rng = random.Random(seed)
    board = SensorBoard(device, link, boot=boot, start=start)
    board.interval = 1.0 / rate
    path = board.plug()
    print(f"{path}" + (f" (link {link})" if link else ""), flush=True)
    log.info(
        "board %s on %s: replaying NERACOOS buoy B01 sea-surface temperature from row %d, %g reading(s)/s",
        device,
        path,
        start,
        rate,
    )
    sent = 0
    now = time.monotonic()
    next_unplug = now + unplug_every if unplug_every > 0 else float("inf")
    next_reboot = now + reboot_every if reboot_every > 0 else float("inf")
    try:
        while not stop.is_set() and (count <= 0 or sent < count):
            if rng.random() < faults.get("garbage", 0):
                board.send_garbage()
            if rng.random() < faults.get("too_long", 0):
                board.send_too_long()
            if rng.random() < faults.get("bad_crc", 0):
                board.send_bad_crc()
            else:
                board.send_reading()
            sent += 1
            now = time.monotonic()
            if now >= next_reboot:
                board.reboot()
                log.info("%s rebooted: boot %d, seq 0", device, board.boot)
                next_reboot = now + reboot_every
            if now >= next_unplug:
                log.info("unplugging %s for 2s", device)
                board.unplug()
                stop.wait(2.0)
                path = board.plug()
                log.info("replugged %s on %s", device, path)
                next_unplug = time.monotonic() + unplug_every
            stop.wait(board.interval)
    finally:
        board.close()
    return 0
