"""vLLM adapters (installed as kvtier.connectors)."""


def register() -> None:
    """vllm.general_plugins entry point; connectors register themselves here."""
