"""What vLLM's secondary tiers read of an ``OffloadingSpec``: its config's model name and
the chunk geometry. A real spec needs a running engine's KV cache config (and vLLM's CPU
platform refuses CPU offloading), so the peer tier's adapter tests build this instead."""

from __future__ import annotations

from types import SimpleNamespace


def offloading_spec(model: str = "/models/tiny", tokens_per_block: int = 16,
                    blocks_per_chunk: int = 1) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(model=SimpleNamespace(name=model)),
                           tokens_per_block=(tokens_per_block,),
                           blocks_per_chunk=blocks_per_chunk)
