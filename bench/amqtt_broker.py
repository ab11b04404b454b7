"""Run amqtt (the Python reference broker) on 127.0.0.1:PORT with logging at WARNING and no plugins but the
user-name check (any user name, no password).

Runs with bench/.venv-amqtt/bin/python (amqtt lives in its own venv, never in the project's):

    bench/.venv-amqtt/bin/python bench/amqtt_broker.py PORT

SIGTERM/SIGINT stop it. amqtt has no inflight-window or queue-length settings; its defaults apply.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from amqtt.broker import Broker


async def serve(port: int) -> None:
    config = {
        "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}},
        # With allow_anonymous true amqtt marks every session anonymous and forgets it on disconnect, even with
        # Clean Session = 0; false still admits any client that sends a user name (the load generator does).
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": False}},
    }
    broker = Broker(config)
    await broker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"amqtt ready on 127.0.0.1:{port}", file=sys.stderr, flush=True)
    await stop.wait()
    await broker.shutdown()


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(int(sys.argv[1])))


if __name__ == "__main__":
    main()
