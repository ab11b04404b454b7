"""The race closed by ``gateway.aiomqtt_client.Client`` (used by the upstream link and firmware-bridge): paho asks
for its socket to be registered for writing, and the connection closes before the event loop gets to it.

Driven deterministically with a real socket pair and the real paho client inside aiomqtt: the registration callback
runs, the socket is closed, then the loop runs what was scheduled. aiomqtt's own ``Client`` passes the closed
descriptor to ``add_writer`` (asyncio reports "Bad file descriptor" to the loop's exception handler, which logs a
traceback; the firmware-bridge restart test saw it under load); ours registers nothing for a closed socket and
still registers, and writes through, an open one.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import aiomqtt
import pytest

from gateway.aiomqtt_client import Client


async def _register_then_close(client: aiomqtt.Client, close: bool) -> tuple[list[dict[str, Any]], socket.socket]:
    """Make ``sock`` paho's socket, run paho's register-write callback, optionally close the socket, then let the
    loop run what the callback scheduled; returns what reached the loop's exception handler and the peer."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    sock, peer = socket.socketpair()
    paho = client._client
    paho._sock = sock  # what paho does in connect(); the test stands in for the connect
    try:
        client._on_socket_register_write(paho, None, sock)
        if close:
            sock.close()
        for _ in range(3):
            await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(None)
    return errors, peer


async def test_aiomqtt_itself_hands_a_closed_descriptor_to_add_writer() -> None:
    """The failure the subclass exists for (if a later aiomqtt fixes it, this test says so)."""
    errors, peer = await _register_then_close(aiomqtt.Client("127.0.0.1", 1), close=True)
    peer.close()
    assert len(errors) == 1, errors
    assert isinstance(errors[0].get("exception"), OSError)


async def test_a_socket_closed_before_the_loop_registers_it_is_skipped() -> None:
    errors, peer = await _register_then_close(Client("127.0.0.1", 1), close=True)
    peer.close()
    assert errors == []


async def test_an_open_socket_is_registered_and_paho_writes_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    client = Client("127.0.0.1", 1)
    writes: list[int] = []
    monkeypatch.setattr(client._client, "loop_write", lambda: writes.append(1) or 0)
    errors, peer = await _register_then_close(client, close=False)
    sock = client._client._sock
    try:
        assert errors == []
        assert writes, "the writer was not registered: loop_write never ran on a writable socket"
    finally:
        asyncio.get_running_loop().remove_writer(sock.fileno())
        client._client._sock = None
        sock.close()
        peer.close()
