"""edge-gateway: an MQTT 3.1.1 + 5.0 edge broker with durable sessions."""

__version__ = "0.1.0"
