"""The fleet data pipeline: what happens to gateway readings once they reach the cloud broker.

- ``pipeline.lander``: MQTT subscriber (aiomqtt, persistent QoS 1 session, manual acks) that appends the raw
  messages as JSON lines to an immutable landing area, acknowledging only what is fsynced and renamed.
- ``pipeline.jobs``: PySpark batch jobs (clean, dedup, windows, completeness, latency) writing Parquet tables
  partitioned by date, rebuilt idempotently for a date range.
- ``pipeline.streaming``: the same cleaning and dedup as a Structured Streaming query (file source, watermark).
- ``pipeline.report``: the fleet health report (HTML with plots).

PySpark is an optional dependency (``pip install .[pipeline]``): only the modules that need it import it, and the
gateway never imports this package.
"""

__version__ = "0.1.0"
