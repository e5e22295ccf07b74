"""A regime: a trace plus the stack settings that put it under pressure, in one file.

The settings ride in the trace file's header line under ``"regime"`` (``Trace.load`` ignores
keys it does not know, so a regime file is also a plain trace)::

    {"kind": "kvtier-trace", "version": 1, "name": "regime-decode-scarce", "vocab_size": 4096,
     "regime": {"description": "...", "decode_num_blocks": 160, "max_model_len": 4096, ...}}

``kvtier ab --trace FILE`` applies them (``RegimeSettings``) unless the command line sets the
same thing: ``time_scale`` (waits and device TTLs; the CI-sized run is ``--time-scale`` below
it), ``max_model_len``, ``decode_ttl_s``, the host tier (``host_mib`` per instance, or
``host_fraction`` of the trace's KV working set), the decode nodes' KV capacity
(``decode_num_blocks`` -> ``--num-gpu-blocks-override`` on decode instances only),
``prefill_num_blocks`` likewise, per-role environment (``decode_env``, ``prefill_env``: e.g.
``VLLM_CPU_KVCACHE_SPACE`` in GiB), arguments for every instance (``extra_args``), and the
TTFT SLO the report states (``slo_ttft_p90_s``).

Threading model: immutable values and pure functions (file I/O in ``read_regime`` /
``save_regime`` only).
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from kvtier.ab.traces import Trace, turn_plan


class RegimeSettings(BaseModel):
    """Stack settings of a regime (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    description: str = ""
    time_scale: float | None = Field(None, gt=0)
    max_model_len: int | None = Field(None, ge=64)
    decode_ttl_s: float | None = Field(None, gt=0)
    host_mib: float | None = Field(None, gt=0)
    # host tier per instance = this fraction of the trace's KV working set (the sum over
    # conversations of their largest context, x KV bytes per token); needs the model's
    # KV size, so it is resolved when the run starts
    host_fraction: float | None = Field(None, gt=0)
    decode_num_blocks: int | None = Field(None, ge=1)
    prefill_num_blocks: int | None = Field(None, ge=1)
    decode_env: dict[str, str] = Field(default_factory=dict)
    prefill_env: dict[str, str] = Field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    slo_ttft_p90_s: float | None = Field(None, gt=0)

    def role_args(self) -> dict[str, tuple[str, ...]]:
        """Extra vLLM arguments per role ("prefill", "decode")."""
        out: dict[str, tuple[str, ...]] = {}
        for role, n in (("prefill", self.prefill_num_blocks), ("decode", self.decode_num_blocks)):
            if n is not None:
                out[role] = ("--num-gpu-blocks-override", str(n))
        return out

    def role_env(self) -> dict[str, dict[str, str]]:
        return {k: dict(v) for k, v in (("prefill", self.prefill_env),
                                        ("decode", self.decode_env)) if v}

    def host_bytes(self, trace: Trace, kv_bytes_per_token: int) -> int | None:
        """Host tier bytes per instance: ``host_mib``, else ``host_fraction`` of the working
        set, else None (the connector config's own size)."""
        if self.host_mib is not None:
            return int(self.host_mib * (1 << 20))
        if self.host_fraction is not None:
            return max(1 << 20, int(self.host_fraction * working_set_bytes(trace,
                                                                          kv_bytes_per_token)))
        return None


def working_set_bytes(trace: Trace, kv_bytes_per_token: int) -> int:
    """KV bytes of every conversation's largest context, summed: what a host tier holding
    every conversation's latest turn at once would need."""
    tokens = sum(max((p.context_after for p in turn_plan(c)), default=0)
                 for c in trace.conversations)
    return tokens * kv_bytes_per_token


def read_regime(path: str | Path) -> RegimeSettings | None:
    """The ``"regime"`` of a trace file's header line, or None (a plain trace)."""
    with open(path, "rb") as f:
        first = f.readline()
    try:
        head = json.loads(first)
    except ValueError:
        return None
    if not isinstance(head, dict) or "regime" not in head:
        return None
    return RegimeSettings.model_validate(head["regime"])


def save_regime(trace: Trace, settings: RegimeSettings, path: str | Path) -> None:
    """Write ``trace`` with ``settings`` in its header line (``Trace.save`` format otherwise)."""
    path = Path(path)
    trace.save(path)
    lines = path.read_bytes().split(b"\n", 1)
    head = json.loads(lines[0])
    head["regime"] = settings.model_dump(exclude_defaults=True, mode="json")
    path.write_bytes(json.dumps(head, separators=(",", ":")).encode() + b"\n" + lines[1])
