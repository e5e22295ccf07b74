"""The KV-aware P/D router (installed as kvtier.router)."""
