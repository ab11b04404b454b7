"""firmware-bridge: sensor boards on serial ports -> the gateway broker, and commands back.

Modules: ``frames`` (the wire format, sans-I/O), ``serial_io`` (pyserial + pyserial-asyncio-fast),
``publisher`` (aiomqtt, persistent session, bounded buffer), ``bridge`` (the service), ``simulator`` (a fake
board on a pseudo-terminal), ``config`` (TOML), ``cli`` (the ``firmware-bridge`` command).
"""

__version__ = "0.1.0"
