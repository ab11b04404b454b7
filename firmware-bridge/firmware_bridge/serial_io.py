"""Serial ports with pyserial (asyncio through pyserial-asyncio-fast): open, read, survive unplugging.

A :class:`SerialLink` owns one configured port. It opens the path (prefer the stable
``/dev/serial/by-id/...`` symlink), feeds every byte to the port's sans-I/O decoder and hands the events to the
bridge. When the device disappears or an I/O error occurs it logs once, closes, and retries opening with
exponential backoff until the device returns; no restart needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from typing import Any

import serial
import serial_asyncio_fast

from firmware_bridge.config import PortConfig
from firmware_bridge.frames import Event, FrameDecoder, NmeaDecoder

log = logging.getLogger("firmware_bridge.serial")


class _PortProtocol(asyncio.Protocol):
    """Thin asyncio glue: bytes to the decoder, events to the link."""

    def __init__(self, link: SerialLink) -> None:
        self.link = link
        self.lost: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.link.bytes_in += len(data)
        try:
            events = self.link.decoder.feed(data)
        except Exception:  # the decoders never raise; if one ever does, keep the port alive
            log.exception("decoder error on %s", self.link.cfg.path)
            self.link.decoder.reset()
            return
        for event in events:
            self.link.on_event(self.link, event)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(exc)


class PortLink:
    """What every port's task shares (:class:`SerialLink`, :class:`firmware_bridge.modbus_bus.ModbusBus`):
    ``state`` (``"closed"`` or ``"open"``) and the ``on_state(link, state, detail)`` callback told of each change."""

    state: str
    on_state: Callable[[Any, str, str], None] | None

    def _set_state(self, state: str, detail: str) -> None:
        self.state = state
        if self.on_state is not None:
            self.on_state(self, state, detail)


class SerialLink(PortLink):
    """One serial port: reopened forever until :meth:`close`.

    Attributes:
        state: ``"closed"`` or ``"open"``; opens/errors: counters.
    """

    def __init__(
        self,
        cfg: PortConfig,
        on_event: Callable[[SerialLink, Event], None],
        on_state: Callable[[SerialLink, str, str], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.on_event = on_event
        self.on_state = on_state
        self.decoder: FrameDecoder | NmeaDecoder = (
            NmeaDecoder(cfg.max_line) if cfg.protocol == "nmea" else FrameDecoder(cfg.max_line)
        )
        self.state = "closed"
        self.opens = 0
        self.errors = 0
        self.bytes_in = 0
        self.bytes_out = 0
        self._transport: Any = None
        self._closing = False
        self._wake = asyncio.Event()

    @property
    def is_open(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    def write(self, data: bytes) -> bool:
        """Queue ``data`` for the port; False when the port is not open."""
        if not self.is_open:
            return False
        self._transport.write(data)
        self.bytes_out += len(data)
        return True

    async def _open(self) -> _PortProtocol:
        loop = asyncio.get_running_loop()
        protocol = _PortProtocol(self)
        self._transport, _ = await serial_asyncio_fast.create_serial_connection(
            loop,
            lambda: protocol,
            self.cfg.path,
            baudrate=self.cfg.baudrate,
            bytesize=self.cfg.bytesize,
            parity=self.cfg.parity,
            stopbits=self.cfg.stopbits,
            rtscts=self.cfg.rtscts,
            exclusive=True,
        )
        return protocol

    async def run(self) -> None:
        """Open, read until lost, back off, reopen; returns after :meth:`close`."""
        delay = 0.05
        failing = False  # logged the current outage already
        while not self._closing:
            try:
                protocol = await self._open()
            except (serial.SerialException, OSError, ValueError) as exc:
                self._transport = None
                if not failing:
                    self.errors += 1
                    log.warning(
                        "port %s unavailable: %s; retrying (backoff up to %gs)",
                        self.cfg.path,
                        _reason(exc),
                        self.cfg.reopen_max,
                    )
                    failing = True
                await self._sleep(delay)
                delay = min(self.cfg.reopen_max, delay * 2) * random.uniform(0.8, 1.0)
                continue
            self.opens += 1
            self.decoder.reset()
            log.info("port %s open (%s, %d baud)", self.cfg.path, self.cfg.protocol, self.cfg.baudrate)
            self._set_state("open", "")
            failing = False
            delay = 0.05
            closer = asyncio.ensure_future(self._wake.wait())
            try:
                first: set[asyncio.Future[Any]] = {protocol.lost, closer}
                await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
            finally:
                closer.cancel()
            if protocol.lost.done():
                lost = protocol.lost.result()
                self.errors += 1
                self._transport = None
                self.decoder.reset()
                if not self._closing:
                    log.warning("port %s lost: %s; reopening", self.cfg.path, _reason(lost))
                    failing = True
                self._set_state("closed", _reason(lost))
                await self._sleep(delay)
            else:
                await self._close_transport(protocol)
        self._set_state("closed", "stopped")

    async def _close_transport(self, protocol: _PortProtocol) -> None:
        if self._transport is not None:
            self._transport.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(protocol.lost), 2.0)
            self._transport = None

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)

    def close(self) -> None:
        """Stop reopening and close the port."""
        self._closing = True
        self._wake.set()


def _reason(exc: BaseException | None) -> str:
    if exc is None:
        return "closed"
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]
