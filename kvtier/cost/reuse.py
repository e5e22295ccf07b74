"""Reuse arithmetic: how many tokens a prefill can take from a KV source.

``M = max(0, min(C, N) - L)``, aligned to blocks, where
  C = tokens the source holds for this prefix,
  N = tokens in the new prompt,
  L = tokens already computed locally (the engine's own prefix-cache hit).

C and L are whole blocks in practice (only full blocks are cached); N is
not, so ``min(C, N)`` is aligned down to a block boundary. vLLM always
recomputes at least the last prompt token to produce logits; when the source
covers the whole prompt the engine itself trims that token, so this function
does not. The fleet simulator (``kvtier.ab.simulator``) counts every offer with it.

Threading model: pure functions.
"""

from __future__ import annotations


def align_down(tokens: int, block_size: int) -> int:
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return (max(0, tokens) // block_size) * block_size


def reusable_tokens(cached: int, prompt: int, local: int, block_size: int) -> int:
    """Tokens worth loading from a source: ``max(0, align(min(C, N)) - L)``."""
    if min(cached, prompt, local) < 0:
        raise ValueError(f"negative token count: C={cached} N={prompt} L={local}")
    return max(0, align_down(min(cached, prompt), block_size) - local)
