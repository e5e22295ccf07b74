"""Cost model: what a turn's TTFT costs on each KV path, fitted from measurements.

The one cost model of kvtier: the CostAwareConnector, the router and the simulator all decide
through it (``kvtier.cost.decide``), ``kvtier calibrate`` fits it (``kvtier.cost.fit``) and the
device-TTL choice weighs memory against it (``kvtier.cost.retention``).

Three ingredients, each fitted from samples a live stack produces (`kvtier calibrate`):

- **KV size.** ``kv_bytes_per_token = layers × 2 (K and V) × kv_heads × head_dim × dtype bytes``
  from the model's HF ``config.json`` (MLA models: ``layers × (kv_lora_rank + qk_rope_head_dim)``).
- **Prefill.** ``prefill_s(new, cached) = a + b·new + c·new·(cached + new/2)``: a fixed step
  cost, a per-token cost (the MLPs and projections), and attention, where each of the ``new``
  tokens attends to the ``cached`` prefix and, on average, to half of the new ones.
- **Reads.** Per path (``"dp_read"``: decode device → prefill over NIXL; ``"p2p"``: a peer's
  host tier; ``"host_local"``: the instance's own host tier): ``setup_s + bytes / bytes_per_s``.
  ``"local"`` (the engine's own prefix cache) is free.

The break-even that sets both router thresholds falls out of the prefill form. Take a
prompt of ``L`` locally cached tokens, then ``n`` tokens a source could supply, then ``m``
tokens nobody has. Recomputing the ``n`` costs ``prefill_s(n+m, L) - prefill_s(m, L+n)
= b·n + c·n·(L + n/2)`` more than loading them — independent of ``m`` (the suffix attends
to the ``n`` tokens either way) and of ``a`` (one prefill happens either way). Loading
costs ``setup_s + n·kv_bytes_per_token / bytes_per_s``. The smallest ``n`` where loading
wins is the threshold: vLLM's ``kv_recompute_threshold`` for ``dp_read`` (it skips a D→P
pull of fewer tokens), the router's ``min_cached_token_delta`` for ``p2p``.

Threading model: every class here is an immutable value, safe to share between threads.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvtier.ids import ReusePath

NEVER = 1 << 30  # a threshold that never lets the path win (0 would mean "always", in vLLM)


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LinkModel(_Frozen):
    """One read path: a fixed setup cost plus bytes over a bandwidth."""

    setup_s: float = Field(ge=0.0)
    bytes_per_s: float = Field(gt=0.0)

    def seconds(self, nbytes: int) -> float:
        return 0.0 if nbytes <= 0 else self.setup_s + nbytes / self.bytes_per_s


# The prior link, where nothing was measured: NIXL/UCX DRAM->DRAM between two processes on one
# host, measured on the CPU machines kvtier is developed on (docs/FACTS.md): ~4 GB/s, a few ms
# of setup. A fit borrows it for a path no sample took (``kvtier.cost.fit``); the A/B
# harness's prior cost model reads over it (``kvtier.ab.live.common.prior_cost_model``).
NIXL_CPU_PRIOR = LinkModel(setup_s=0.002, bytes_per_s=4e9)


class Recommendation(_Frozen):
    """Router/connector thresholds derived from a CostModel, with the reasoning."""

    kv_recompute_threshold: int  # vLLM: skip a D->P pull of fewer tokens than this
    min_cached_token_delta: int  # router: fetch from a peer host only if it has this many more tokens
    dp_read_break_even_tokens: float | None  # exact break-even (None: the path never wins)
    p2p_break_even_tokens: float | None
    local_context_tokens: int  # L the break-even was computed at
    block_size: int
    explanation: str


class CostModel(_Frozen):
    """Fitted costs of one model on one deployment. See the module docstring."""

    kv_bytes_per_token: int = Field(gt=0)
    prefill_a_s: float = Field(0.0, ge=0.0)
    prefill_b_s_per_token: float = Field(0.0, ge=0.0)
    prefill_c_s_per_token_ctx: float = Field(0.0, ge=0.0)
    decode_s_per_token: float = Field(0.0, ge=0.0)  # TPOT, for end-to-end latency and occupancy
    reads: dict[str, LinkModel] = Field(default_factory=dict)
    block_size: int = Field(32, ge=1)
    fit_notes: tuple[str, ...] = ()  # how each part was fitted (kvtier.cost.fit), for reports

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_model_config(cls, config_json: dict[str, Any], dtype_bytes: int = 2, **kw: Any) -> CostModel:
        """A model whose KV size comes from a HF ``config.json``; other fields from ``kw``."""
        return cls(kv_bytes_per_token=kv_bytes_per_token(config_json, dtype_bytes), **kw)

    # ------------------------------------------------------------------ costs

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        if new_tokens < 0 or cached_tokens < 0:
            raise ValueError(f"negative tokens: new={new_tokens} cached={cached_tokens}")
        n = float(new_tokens)
        return (self.prefill_a_s + self.prefill_b_s_per_token * n
                + self.prefill_c_s_per_token_ctx * n * (cached_tokens + n / 2))

    def read_s(self, path: str, tokens: int) -> float:
        if tokens <= 0 or path == ReusePath.LOCAL:
            return 0.0
        try:
            link = self.reads[path]
        except KeyError:
            raise KeyError(f"no read model for path {path!r}; have {sorted(self.reads)}") from None
        return link.seconds(tokens * self.kv_bytes_per_token)

    def ttft_s(self, path: str | None, prompt_tokens: int, reused_tokens: int, *, local_tokens: int = 0) -> float:
        """Read ``reused_tokens`` over ``path`` on top of ``local_tokens`` cached, then prefill the rest.

        The engine always computes at least the last prompt token (it needs its logits),
        so reuse is capped at ``prompt_tokens - 1``. ``path=None`` means no read.
        """
        if prompt_tokens < 1:
            raise ValueError("prompt_tokens must be >= 1")
        local = min(max(0, local_tokens), prompt_tokens - 1)
        reused = 0 if path is None else min(max(0, reused_tokens), prompt_tokens - 1 - local)
        read = self.read_s(path, reused) if path is not None else 0.0
        return read + self.prefill_s(prompt_tokens - local - reused, local + reused)

    # ------------------------------------------------------------------ thresholds

    def break_even_tokens(self, path: str, local_tokens: int = 0) -> float | None:
        """Smallest real ``n`` where reading ``n`` tokens over ``path`` is no slower than
        recomputing them with ``local_tokens`` cached before them; None if never."""
        link = self.reads[path]
        k = self.kv_bytes_per_token / link.bytes_per_s  # read seconds per token
        # saving(n) = (b + c·L - k)·n + (c/2)·n² - setup; find its smallest nonnegative root
        lin = self.prefill_b_s_per_token + self.prefill_c_s_per_token_ctx * local_tokens - k
        quad = self.prefill_c_s_per_token_ctx / 2
        setup = link.setup_s
        if quad == 0:
            if lin <= 0:
                return None
            return setup / lin
        disc = lin * lin + 4 * quad * setup
        return max(0.0, (-lin + math.sqrt(disc)) / (2 * quad))

    def recommend(self, local_tokens: int = 0) -> Recommendation:
        """Thresholds for this model and link; ``local_tokens`` is the cached context ``L``
        assumed in front of the pulled tokens (0, the default, is the conservative choice:
        recompute is cheapest there, so the thresholds come out highest)."""
        bs = self.block_size

        def threshold(path: str) -> tuple[int, float | None, str]:
            if path not in self.reads:
                return NEVER, None, f"{path}: no measurement, path disabled"
            n = self.break_even_tokens(path, local_tokens)
            link = self.reads[path]
            bw = f"{link.bytes_per_s / 1e9:.3g} GB/s, setup {link.setup_s * 1e3:.3g} ms"
            if n is None:
                return NEVER, None, (f"{path}: reading never beats recomputing ({bw}; "
                                     f"{self.kv_bytes_per_token} B/token costs more than compute per token)")
            # Reuse comes in whole blocks, so any threshold in (k·bs - bs, k·bs] acts the same.
            t = max(bs, math.ceil(max(n, 1.0) / bs) * bs)
            saved = self.prefill_s(t, local_tokens) - self.prefill_a_s - self.read_s(path, t)
            return t, n, (f"{path}: break-even at {n:.0f} tokens ({bw}); "
                          f"threshold {t} tokens (whole blocks of {bs}); at {t} tokens a read saves "
                          f"{saved * 1e3:.3g} ms")

        dp, dp_n, dp_why = threshold("dp_read")
        p2p, p2p_n, p2p_why = threshold("p2p")
        expl = (f"KV {self.kv_bytes_per_token} B/token; prefill {self.prefill_a_s * 1e3:.3g} ms + "
                f"{self.prefill_b_s_per_token * 1e6:.3g} us/token + "
                f"{self.prefill_c_s_per_token_ctx * 1e9:.3g} ns/token/context-token; at L={local_tokens}: "
                f"{dp_why}; {p2p_why}.")
        return Recommendation(kv_recompute_threshold=dp, min_cached_token_delta=p2p,
                              dp_read_break_even_tokens=dp_n, p2p_break_even_tokens=p2p_n,
                              local_context_tokens=local_tokens, block_size=bs, explanation=expl)


def kv_bytes_per_token(config_json: dict[str, Any], dtype_bytes: int = 2) -> int:
    """Bytes of KV cache one token occupies, from a HF ``config.json`` dict."""
    cfg = config_json.get("text_config", config_json)  # multimodal wrappers nest the LM
    layers = int(cfg["num_hidden_layers"])
    if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-style): one latent plus the rope part, no K/V pair
        return layers * (int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim", 0))) * dtype_bytes
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    return layers * 2 * kv_heads * head_dim * dtype_bytes
