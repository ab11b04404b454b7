"""asyncio glue: listeners, the protocol adapter, the ticker, the runner and config loading."""
