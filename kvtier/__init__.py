"""kvtier: tiered KV-cache store, KV-event indexer and KV-aware P/D router for vLLM."""

__version__ = "0.1.0"
