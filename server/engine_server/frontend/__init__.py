"""The asyncio frontend of the engine: the process boundary, detokenization, stop strings."""
