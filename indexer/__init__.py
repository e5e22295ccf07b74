"""The standalone KV-event indexer daemon (installed as kvtier.indexer)."""
