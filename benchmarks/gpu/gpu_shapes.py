"""Model shapes and pure arithmetic for the GPU calibration (no torch, no kvtier imports).

`calibrate_gpu.py` runs on the lent H200 with only torch + numpy; `validate.py` runs here with kvtier.
Both import this file by path (``benchmarks/`` is not a package), and
``tests/unit/test_benchmarks_gpu_calibration.py`` checks the arithmetic.

Threading model: pure functions and frozen dataclasses; nothing is shared or mutated.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A Llama/Qwen decoder layout (bf16, random weights) whose prefill we time.

    ``q_dim`` is heads * head_dim; Qwen3-32B has q_dim 8192 != hidden 5120, so both are kept.
    """

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    note: str = ""

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of every layer for one token: 2 * layers * kv_heads * head_dim * dtype_bytes."""
        return 2 * self.layers * self.kv_dim * dtype_bytes

    def kv_bytes_per_token_per_layer(self, dtype_bytes: int = 2) -> int:
        return 2 * self.kv_dim * dtype_bytes

    def params_per_layer(self) -> int:
        """Matrix parameters of one decoder layer (fused qkv, o, gate+up, down; norms ignored)."""
        qkv = self.hidden * (self.q_dim + 2 * self.kv_dim)
        o = self.q_dim * self.hidden
        mlp = 3 * self.hidden * self.intermediate
        return qkv + o + mlp

    def params(self) -> int:
        """Decoder-stack parameters plus embedding and LM head (untied)."""
        return self.layers * self.params_per_layer() + 2 * self.vocab * self.hidden

    def prefill_flops(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """FLOPs of one prefill of ``new_tokens`` after ``cached_tokens`` (whole stack, LM head on 1 token).

        Linear layers: 2 * params * new. Attention (causal): QK^T and PV each cost
        2 * new * (cached + (new + 1) / 2) * q_dim per layer.
        """
        linear = 2.0 * self.params_per_layer() * new_tokens * self.layers
        attended = new_tokens * (cached_tokens + (new_tokens + 1) / 2.0)
        attention = 4.0 * attended * self.q_dim * self.layers
        head = 2.0 * self.vocab * self.hidden
        return linear + attention + head

    def hf_config(self) -> dict[str, object]:
        """A HuggingFace-style config.json dict (what CostModel.from_model_config reads)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate,
            "vocab_size": self.vocab,
            "torch_dtype": "bfloat16",
        }


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape("llama8b", 4096, 32, 32, 8, 128, 14336, 128256, "Llama-3.1-8B layout"),
        ModelShape("qwen25_32b", 5120, 64, 40, 8, 128, 27648, 152064, "Qwen2.5-32B layout"),
        ModelShape(
            "qwen3_32b", 5120, 64, 64, 8, 128, 25600, 151936,
            "Qwen3-32B layout (q/k RMSNorm omitted), the model of the published curve",
        ),
        ModelShape("smoke", 256, 4, 4, 2, 64, 512, 1000, "tiny CPU smoke-test shape"),
    )
}


def prefill_grid(totals: Sequence[int], news: Sequence[int]) -> list[tuple[int, int]]:
    """(new_tokens, cached_tokens) points: for every total context T, a full recompute (new = T) and
    every ``n`` in ``news`` with n < T (cached = T - n). Sorted, no duplicates."""
    points: set[tuple[int, int]] = set()
    for total in totals:
        if total <= 0:
            raise ValueError(f"total context must be positive, got {total}")
        points.add((total, 0))
        for n in news:
            if 0 < n < total:
                points.add((n, total - n))
    return sorted(points, key=lambda p: (p[0] + p[1], p[0]))


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))


def scale_layers(seconds_for_k_layers: float, k: int, layers: int) -> float:
    """Stack time from a timing of ``k`` identical layers (embedding/LM head are ignored: < 0.5%)."""
    if k <= 0 or layers <= 0 or k > layers:
        raise ValueError(f"bad layer counts k={k} layers={layers}")
    return seconds_for_k_layers * layers / k
