"""The five retention strategies of ``kvtier ab``: each a configured deployment of one stack.

=================  ===========================================================================
``recompute``      no reuse: unidirectional NixlConnector (the decode node keeps nothing after
                   a turn), no host tier, no indexer. Every turn prefills its whole prompt.
``device-ttl``     vLLM bidirectional NixlConnector: the decode node pins a turn's KV for a
                   fixed ``decoder_kv_blocks_ttl``; the next turn's prefill reads it D->P when
                   at least ``kv_recompute_threshold`` tokens would be pulled.
``host-p2p``       no device retention (unidirectional Nixl) + KVTierConnector on every
                   instance: host tiers keep prompt *and generated* blocks, the indexer sees
                   them (tier events, medium CPU) and the router asks it for a peer source;
                   the prefill pulls from a peer's host tier when it saves
                   ``min_cached_token_delta`` tokens or more.
``tiered``         both: a short device TTL covers short tool waits (D->P read), the host copy
                   covers long ones (peer fetch), and small deltas are recomputed
                   (``kv_recompute_threshold`` / ``min_cached_token_delta``).
``tiered-adaptive`` as tiered, with both thresholds taken from the cost model
                   (``CostModel.recommend()``) and the device TTL from the cost model and
                   the tool waits seen so far (``kvtier.cost.retention``: hold on device
                   only while the device read saves more than the memory costs), and the
                   path picked per request by cost (``kvtier.cost.decide``) in the simulator,
                   which also re-chooses the TTL online as waits arrive. Live, vLLM fixes
                   ``kv_recompute_threshold`` and ``decoder_kv_blocks_ttl`` when an
                   instance starts, so the live run uses the values calibrated on the
                   runs before it.
=================  ===========================================================================

A ``StrategySpec`` is pure data; the live runner turns it into a
``StackSpec`` (``kvtier.ab.live.runner.stack_spec_for``), a vLLM ``--kv-transfer-config``
(``kv_transfer_config``) and router settings (``router_settings``); the
simulator reads the same fields.

The prefill instances' own prefix cache is off in every strategy by default
(``prefix_caching``): on a one-prefill local stack with a 1 GiB cache it would
hold every conversation's previous prompt forever, which no busy fleet does,
and would hide exactly the retention choice being compared. Turn it on to
measure the local stack as-is.

Threading model: immutable values, share freely.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvtier.configs import load_config_file
from kvtier.cost.model import CostModel
from kvtier.cost.retention import TtlChoice, WaitSample, choose_device_ttl

StrategyName = Literal["recompute", "device-ttl", "host-p2p", "tiered", "tiered-adaptive"]
STRATEGY_NAMES: tuple[str, ...] = ("recompute", "device-ttl", "host-p2p", "tiered",
                                   "tiered-adaptive")

# vLLM's NixlConnector defaults (docs/FACTS.md): 480 s decode TTL, 64-token recompute threshold.
VLLM_DEFAULT_TTL_S = 480.0
VLLM_DEFAULT_RECOMPUTE_THRESHOLD = 64
# The short device TTL of `tiered`: covers the median tool wait of agentic traces
# (seconds), leaves the long tail to the host copy.
TIERED_DEVICE_TTL_S = 30.0


class StrategySpec(BaseModel):
    """One retention strategy, as data. See the module docstring for the five."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: StrategyName
    description: str = ""
    # Config files in configs/ (names without .json); several are combined into
    # a MultiConnector in this order (vLLM loads from the first child that matches).
    kv_configs: tuple[str, ...]
    device_retention: bool           # decode pins a turn's KV (bidirectional Nixl)
    decode_ttl_s: float | None = None  # decoder_kv_blocks_ttl when device_retention
    host_tier: bool = False          # KVTierConnector host tier (prompt + generated)
    peer_fetch: bool = False         # prefill may pull from a peer host tier
    use_indexer: bool = False        # router asks the indexer (lookup + source)
    dp_reuse: bool = False           # router hands D's params to the next prefill
    kv_recompute_threshold: int = Field(VLLM_DEFAULT_RECOMPUTE_THRESHOLD, ge=0)
    min_cached_token_delta: int = Field(0, ge=0)
    adaptive: bool = False           # thresholds and device TTL from the cost model
    # adaptive: holding a turn's blocks this long costs as much as recomputing them
    # (kvtier.cost.retention); sets how long the device TTL may grow.
    retention_horizon_s: float = Field(60.0, gt=0)
    # Host tier size per instance (cpu_bytes_to_use); None keeps the config file's.
    host_bytes: int | None = Field(None, gt=0)
    prefix_caching: bool = False     # engines' own prefix cache (see module docstring)
    prefill: int = Field(1, ge=1)
    decode: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _check(self) -> "StrategySpec":
        if self.device_retention and not self.decode_ttl_s:
            raise ValueError(f"{self.name}: device retention needs decode_ttl_s > 0")
        if self.dp_reuse and not self.device_retention:
            raise ValueError(f"{self.name}: dp_reuse needs device_retention")
        if self.peer_fetch and not (self.host_tier and self.use_indexer):
            raise ValueError(f"{self.name}: peer_fetch needs host_tier and use_indexer")
        if self.prefill + self.decode > 3:
            raise ValueError("the local stack runs at most 3 instances")
        return self

    # -- variants ---------------------------------------------------------------------------
    def with_ttl(self, decode_ttl_s: float) -> "StrategySpec":
        """The same strategy with another decode TTL (no-op without device retention)."""
        if not self.device_retention:
            return self
        return self.model_copy(update={"decode_ttl_s": float(decode_ttl_s)})

    def scaled(self, time_scale: float) -> "StrategySpec":
        """Times scaled like the trace's waits (``--time-scale``): the TTL shrinks with them
        so a shortened demo stays in the same regime (which waits outlive the TTL)."""
        if not self.device_retention or time_scale == 1.0:
            return self
        return self.with_ttl(max(1.0, self.decode_ttl_s * time_scale))  # type: ignore[operator]

    def with_thresholds(self, kv_recompute_threshold: int,
                        min_cached_token_delta: int) -> "StrategySpec":
        return self.model_copy(update={"kv_recompute_threshold": int(kv_recompute_threshold),
                                       "min_cached_token_delta": int(min_cached_token_delta)})

    def with_cost_model(self, cost: CostModel, waits: Sequence[WaitSample] = ()) -> "StrategySpec":
        """For adaptive strategies: thresholds from ``cost.recommend()`` (a CostModel) and,
        given observed tool waits (``kvtier.cost.retention.WaitSample``), the device TTL from
        ``choose_device_ttl`` -- or no device retention at all when no TTL pays for the
        memory it holds (then the decode node keeps nothing and the router hands the next
        prefill no D->P params; the host copy and recompute remain)."""
        if not self.adaptive:
            return self
        rec = cost.recommend()
        spec = self.with_thresholds(rec.kv_recompute_threshold, rec.min_cached_token_delta)
        if waits and self.device_retention:
            choice = self.adaptive_ttl(cost, waits)
            spec = spec.with_ttl(choice.ttl_s) if choice.retain else spec.without_retention()
        return spec

    def without_retention(self) -> "StrategySpec":
        """The same strategy with the decode node keeping nothing after a turn."""
        return self.model_copy(update={"device_retention": False, "decode_ttl_s": None,
                                       "dp_reuse": False})

    def adaptive_ttl(self, cost: CostModel, waits: Sequence[WaitSample]) -> TtlChoice:
        """The cost model's device TTL for these waits (a ``TtlChoice``)."""

        return choose_device_ttl(cost, waits, host_copy=self.host_tier and self.peer_fetch,
                                 horizon_s=self.retention_horizon_s)

    def with_host_bytes(self, host_bytes: int | None) -> "StrategySpec":
        """The same strategy with another host tier size (no-op without a host tier)."""
        if not self.host_tier or host_bytes is None:
            return self
        return self.model_copy(update={"host_bytes": int(host_bytes)})

    def topology(self, prefill: int, decode: int) -> "StrategySpec":
        return StrategySpec.model_validate({**self.model_dump(), "prefill": prefill,
                                            "decode": decode})

    # -- what the live runner starts ------------------------------------------------------
    def kv_transfer_config(self) -> dict:
        """The ``--kv-transfer-config`` of every instance, with this strategy's knobs set."""
        children = [copy.deepcopy(load_config_file(n)) for n in self.kv_configs]
        for c in children:
            extra = c.setdefault("kv_connector_extra_config", {})
            if c.get("kv_connector") == "NixlConnector":
                extra["bidirectional_kv_xfer"] = self.device_retention
                if self.device_retention:
                    extra["decoder_kv_blocks_ttl"] = _ttl_value(self.decode_ttl_s)
                    extra["kv_recompute_threshold"] = self.kv_recompute_threshold
                else:
                    extra.pop("decoder_kv_blocks_ttl", None)
                    extra.pop("kv_recompute_threshold", None)
            elif c.get("kv_connector") == "KVTierConnector":
                extra["peer_fetch"] = self.peer_fetch
                extra["kv_events"] = self.host_tier
                extra["min_cached_token_delta"] = self.min_cached_token_delta
                if self.host_bytes is not None:
                    extra["cpu_bytes_to_use"] = int(self.host_bytes)
        if len(children) == 1:
            return children[0]
        return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"connectors": children}}

    def router_settings(self) -> dict:
        """RouterConfig fields this strategy sets (instances/indexer URL come from the run)."""
        out: dict = {"min_cached_token_delta": self.min_cached_token_delta}
        if self.device_retention:
            ttl = float(self.decode_ttl_s)  # type: ignore[arg-type]
            out["decode_kv_ttl_s"] = ttl
            # Expire the router's entry a little before D frees the blocks.
            out["ttl_margin_s"] = min(30.0, 0.1 * ttl)
        return out


def _ttl_value(ttl: float | None) -> int:
    # vLLM compares the TTL with perf_counter seconds; whole seconds keep the
    # config readable and match its documented default (480).
    return max(1, round(float(ttl or 0)))


def builtin(name: str, decode_ttl_s: float | None = None) -> StrategySpec:
    """One of the five named strategies; ``decode_ttl_s`` overrides the device TTL."""
    if name not in STRATEGY_NAMES:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGY_NAMES)}")
    spec = _BUILTIN[name]
    return spec.with_ttl(decode_ttl_s) if decode_ttl_s is not None else spec


def parse_list(names: str, decode_ttl_s: float | None = None) -> list[StrategySpec]:
    """``"recompute,device-ttl"`` -> specs, in the given order, duplicates refused."""
    out = [builtin(n.strip(), decode_ttl_s) for n in names.split(",") if n.strip()]
    if len({s.name for s in out}) != len(out):
        raise ValueError(f"duplicate strategy in {names!r}")
    if not out:
        raise ValueError("no strategy given")
    return out


_BUILTIN: dict[str, StrategySpec] = {
    "recompute": StrategySpec(
        name="recompute", description="no reuse: every turn prefills its whole prompt",
        kv_configs=("nixl-unidirectional",), device_retention=False),
    "device-ttl": StrategySpec(
        name="device-ttl",
        description="vLLM bidirectional: decode pins KV for a fixed TTL, next prefill reads D->P",
        kv_configs=("nixl-bidirectional",), device_retention=True,
        decode_ttl_s=VLLM_DEFAULT_TTL_S, dp_reuse=True),
    "host-p2p": StrategySpec(
        name="host-p2p",
        description="host tiers keep prompt+generated KV; prefill pulls from the peer the "
                    "indexer picks; no device retention",
        kv_configs=("nixl-unidirectional", "kvtier-peer"), device_retention=False,
        host_tier=True, peer_fetch=True, use_indexer=True, min_cached_token_delta=32),
    "tiered": StrategySpec(
        name="tiered",
        description="short device TTL for short waits, host copy for long ones, recompute "
                    "for small deltas",
        kv_configs=("nixl-bidirectional", "kvtier-peer"), device_retention=True,
        decode_ttl_s=TIERED_DEVICE_TTL_S, dp_reuse=True, host_tier=True, peer_fetch=True,
        use_indexer=True, kv_recompute_threshold=VLLM_DEFAULT_RECOMPUTE_THRESHOLD,
        min_cached_token_delta=64),
    "tiered-adaptive": StrategySpec(
        name="tiered-adaptive",
        description="tiered with thresholds from the calibrated cost model",
        kv_configs=("nixl-bidirectional", "kvtier-peer"), device_retention=True,
        decode_ttl_s=TIERED_DEVICE_TTL_S, dp_reuse=True, host_tier=True, peer_fetch=True,
        use_indexer=True, adaptive=True, min_cached_token_delta=64),
}
