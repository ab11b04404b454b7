"""aiomqtt's ``Client`` with one race closed: the MQTT client of the upstream link (``gateway/upstream/link.py``)
and of firmware-bridge (``firmware_bridge/publisher.py``).

aiomqtt 2.x registers paho's socket for writing by scheduling ``loop.add_writer(sock.fileno(), ...)`` with
``call_soon_threadsafe``. When the connection closes before the loop runs that call (a broker restart while a
message is being sent), ``add_writer`` is given a descriptor that is already closed: asyncio logs
"Exception in callback ... OSError: [Errno 9] Bad file descriptor" with a traceback, and had the number been
reused by the next connection's socket, the writer would have been registered on it. :class:`Client` checks, when
the loop gets to it, that the socket is still open and still the one paho uses, and otherwise registers nothing
(the closed connection needs no writer; the next one registers its own). The override uses aiomqtt's private
``_loop`` and ``_disconnected`` as aiomqtt's own method does; it is checked against aiomqtt 2.5
(tests/test_aiomqtt_client.py).
"""

from __future__ import annotations

from typing import Any

import aiomqtt

__all__ = ["Client"]


class Client(aiomqtt.Client):
    """``aiomqtt.Client`` whose write registration skips a socket closed meanwhile (see the module docstring)."""

    def _on_socket_register_write(self, client: Any, userdata: Any, sock: Any) -> None:
        def write() -> None:
            # As aiomqtt: a failed write (e.g. EPIPE) is a broken connection; disconnect straight away.
            try:
                client.loop_write()
            except Exception as exc:
                if not self._disconnected.done():
                    self._disconnected.set_exception(exc)

        def register() -> None:
            fileno = sock.fileno()  # -1 once closed
            if fileno != -1 and client.socket() is sock:
                self._loop.add_writer(fileno, write)

        # paho may call this from the executor thread that runs connect(): hand it to the loop.
        self._loop.call_soon_threadsafe(register)
