"""Sans-I/O MQTT 3.1.1 + 5.0 codec: bytes in, packets out. Pure stdlib; no sockets, no clocks."""
