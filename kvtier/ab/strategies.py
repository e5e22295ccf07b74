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
                   (``CostModel.recommend()``), deployed with **decode leases**
                   (``leases``: ``KVTierNixlConnector`` from
                   ``configs/nixl-bidirectional-lease.json`` + the host tier): the router
                   decides online, per conversation and per turn, how long to hold each
                   retained turn on the decode device (``retention: adaptive``,
                   ``kvtier.cost.hold.HoldPolicy``: from the cost model and the waits it
                   has observed so far -- a conversation's own after three of them, the
                   fleet's before) and releases it early when holding does not pay; it
                   also picks the reuse path per turn by cost (``kvtier.cost.decide``).
                   vLLM's ``decoder_kv_blocks_ttl`` stays the upper bound. The simulator
                   applies the same policy per conversation and turn.
``vllm-offload``   the anchor on CUDA: vLLM's own CPU offloading (``OffloadingConnector``,
                   ``offload_prompt_only: false``) on every instance beside unidirectional
                   NixlConnector P->D, no kvtier component in the engines and no indexer.
                   A prefill reuses only what its own CPU tier kept (vLLM 0.26 has no peer
                   fetch: the decode node's copy of the response stays there). vLLM's
                   OffloadingConnector refuses vLLM's CPU platform, so this strategy runs on
                   a GPU only.
=================  ===========================================================================

Without leases (``leases=False``, e.g. a variant built with ``model_copy``) an adaptive
strategy is configured once before its run, as before: vLLM fixes ``kv_recompute_threshold``
and ``decoder_kv_blocks_ttl`` when an instance starts, so the thresholds and the TTL come from
the cost model and the waits of the runs before it (``with_cost_model``), and no device
retention at all when no TTL pays for the memory it holds.

**One engine per strategy** (``single``, ``kvtier ab --single-engine``): the strategies that
need no decode node -- ``recompute``, ``host-p2p`` (kvtier's host tier: on one engine, the
engine's own copy of the previous turn) and ``vllm-offload`` -- each on one engine that serves
whole turns, with no P/D split, no router and no indexer: the client talks to the engine, so
no KV crosses a link between processes. It answers what a tier costs and brings back where
the P->D and D->P moves play no part (on one GPU they cross an in-VM link far slower than a
fleet's). Strategies that retain on a decode node have nothing to retain there and are refused.

A ``StrategySpec`` is pure data; the live runner turns it into a
``StackSpec`` (``kvtier.ab.live.stacks.stack_spec_for``), a vLLM ``--kv-transfer-config``
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
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvtier.configs import load_config_file
from kvtier.cost.model import CostModel
from kvtier.cost.retention import TtlChoice, WaitSample, choose_device_ttl
from kvtier.tier.config import HostTierConfig
from kvtier.tier.params_feed import NixlKnobs, ParamsFeedConfig

# Connectors that carry vLLM's NIXL knobs (bidirectional transfer, decode TTL, recompute
# threshold): vLLM's own and kvtier's subclass with decode leases.
NIXL_CONNECTORS = ("NixlConnector", "KVTierNixlConnector")

StrategyName = Literal["recompute", "device-ttl", "host-p2p", "tiered", "tiered-adaptive",
                       "vllm-offload"]
# The strategies every platform runs (the simulator's, the CPU A/B's); GPU_STRATEGY_NAMES adds
# those that need vLLM's CUDA build.
STRATEGY_NAMES: tuple[str, ...] = ("recompute", "device-ttl", "host-p2p", "tiered",
                                   "tiered-adaptive")
GPU_STRATEGY_NAMES: tuple[str, ...] = ("vllm-offload",)
# The strategies that run on one engine each (``StrategySpec.single``).
SINGLE_ENGINE_NAMES: tuple[str, ...] = ("recompute", "host-p2p", "vllm-offload")

# vLLM's NixlConnector defaults (docs/FACTS.md): 480 s decode TTL, 64-token recompute threshold.
VLLM_DEFAULT_TTL_S = 480.0
VLLM_DEFAULT_RECOMPUTE_THRESHOLD = 64
# The short device TTL of `tiered`: covers the median tool wait of agentic traces
# (seconds), leaves the long tail to the host copy.
TIERED_DEVICE_TTL_S = 30.0
# The decode lease the router asks for (renewed every third of it while a turn is held).
DEFAULT_DECODE_LEASE_S = 30.0
# The shortest lease a (time-scaled) run asks for: vLLM's prefill declines a D->P read within
# 5 s of the blocks' deadline, so a shorter lease would make every read look expired.
MIN_DECODE_LEASE_S = 6.0


# vLLM's prefill declines a D->P read within 5 s of the blocks' deadline
# (_KV_BLOCKS_EXPIRY_SAFETY_MARGIN); the router stops offering a turn this much earlier, plus
# time for the prefill to reach the read.
VLLM_READ_MARGIN_S = 5.0


def router_ttl_margin_s(ttl_s: float) -> float:
    """How long before vLLM's decode TTL ends the router stops offering a retained turn: a
    tenth of it, at least vLLM's read margin plus 3 s (a live host-scarce run with a 30 s TTL
    and a 3 s margin saw reads declined), at most 30 s, and never more than half the TTL
    (a time-scaled run's TTL of a few seconds)."""
    return min(max(0.1 * ttl_s, VLLM_READ_MARGIN_S + 3.0), 30.0, 0.5 * ttl_s)


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
    # vLLM's own OffloadingConnector CPU tier on every instance (GPU only; host_bytes sizes it)
    vllm_offload: bool = False
    peer_fetch: bool = False         # prefill may pull from a peer host tier
    use_indexer: bool = False        # router asks the indexer (lookup + source)
    dp_reuse: bool = False           # router hands D's params to the next prefill
    kv_recompute_threshold: int = Field(VLLM_DEFAULT_RECOMPUTE_THRESHOLD, ge=0)
    min_cached_token_delta: int = Field(0, ge=0)
    adaptive: bool = False           # thresholds and device TTL from the cost model
    # Decode leases (a KVTierNixlConnector config with decode_lease_s): the router holds each
    # retained turn under a lease it renews or releases; with ``adaptive`` and a cost model,
    # it chooses the hold per conversation and turn (retention: adaptive). The device TTL is
    # then only the upper bound.
    leases: bool = False
    decode_lease_s: float = Field(DEFAULT_DECODE_LEASE_S, gt=0)
    # The cost model the router decides with (adaptive + leases; set by with_cost_model), and
    # whether the router refits it online from the prefill legs it times (cost_refit).
    cost_model: CostModel | None = None
    cost_refit: bool = False
    # ... whether it learns each path's real cost from those legs (cost_learn) and prices
    # holds by the decode node's pressure (hold_pressure); on in tiered-adaptive. Off by
    # default so a spec stored before the router had them replays as that router was.
    cost_learn: bool = False
    hold_pressure: bool = False
    # adaptive: holding a turn's blocks this long costs as much as recomputing them
    # (kvtier.cost.retention); sets how long the device TTL may grow.
    retention_horizon_s: float = Field(60.0, gt=0)
    # Host tier size per instance (cpu_bytes_to_use); None keeps the config file's.
    host_bytes: int | None = Field(None, gt=0)
    prefix_caching: bool = False     # engines' own prefix cache (see module docstring)
    prefill: int = Field(1, ge=1)
    decode: int = Field(1, ge=0)     # 0 only with single_engine
    # One engine serves whole turns: no P/D split, no router, no indexer (``single``).
    single_engine: bool = False

    @model_validator(mode="after")
    def _check(self) -> StrategySpec:
        if self.device_retention and not self.decode_ttl_s:
            raise ValueError(f"{self.name}: device retention needs decode_ttl_s > 0")
        if self.dp_reuse and not self.device_retention:
            raise ValueError(f"{self.name}: dp_reuse needs device_retention")
        if self.peer_fetch and not (self.host_tier and self.use_indexer):
            raise ValueError(f"{self.name}: peer_fetch needs host_tier and use_indexer")
        if self.prefill + self.decode > 3:
            raise ValueError("the local stack runs at most 3 instances")
        if self.leases and not self.device_retention:
            raise ValueError(f"{self.name}: leases need device_retention")
        if self.vllm_offload and self.host_tier:
            raise ValueError(f"{self.name}: vLLM's CPU offloading and kvtier's host tier "
                             "are alternatives, not one stack")
        if self.single_engine:
            if (self.prefill, self.decode) != (1, 0) or self.device_retention \
                    or self.use_indexer:
                raise ValueError(f"{self.name}: one engine per strategy is 1 instance, no "
                                 "decode node, no device retention, no indexer")
        elif self.decode < 1:
            raise ValueError(f"{self.name}: a P/D stack needs a decode instance")
        return self

    # -- variants ---------------------------------------------------------------------------
    def with_ttl(self, decode_ttl_s: float) -> StrategySpec:
        """The same strategy with another decode TTL (no-op without device retention)."""
        if not self.device_retention:
            return self
        return self.model_copy(update={"decode_ttl_s": float(decode_ttl_s)})

    def scaled(self, time_scale: float) -> StrategySpec:
        """Times scaled like the trace's waits (``--time-scale``): the TTL shrinks with them
        so a shortened demo stays in the same regime (which waits outlive the TTL)."""
        if not self.device_retention or time_scale == 1.0:
            return self
        out = self.with_ttl(max(1.0, self.decode_ttl_s * time_scale))  # type: ignore[operator]
        if self.leases:
            # the router's price of holding scales with the waits it prices
            out = out.model_copy(update={
                "decode_lease_s": max(MIN_DECODE_LEASE_S, self.decode_lease_s * time_scale),
                "retention_horizon_s": self.retention_horizon_s * time_scale})
        return out

    def with_cost_refit(self, on: bool = True) -> StrategySpec:
        """The router refits its cost model online (adaptive strategies with leases only)."""
        if on and not (self.adaptive and self.leases):
            return self
        return self.model_copy(update={"cost_refit": bool(on)})

    def with_thresholds(self, kv_recompute_threshold: int,
                        min_cached_token_delta: int) -> StrategySpec:
        return self.model_copy(update={"kv_recompute_threshold": int(kv_recompute_threshold),
                                       "min_cached_token_delta": int(min_cached_token_delta)})

    def with_cost_model(self, cost: CostModel, waits: Sequence[WaitSample] = ()) -> StrategySpec:
        """For adaptive strategies: thresholds from ``cost.recommend()`` (a CostModel).

        With decode leases the cost model also goes to the router (``router_settings``),
        which decides the device hold online per conversation and turn; the observed
        ``waits`` change nothing here and vLLM's TTL stays the upper bound. Without leases,
        given observed tool waits (``kvtier.cost.retention.WaitSample``), the device TTL
        comes from ``choose_device_ttl`` -- or no device retention at all when no TTL pays
        for the memory it holds (then the decode node keeps nothing and the router hands the
        next prefill no D->P params; the host copy and recompute remain)."""
        if not self.adaptive:
            return self
        rec = cost.recommend()
        delta = rec.min_cached_token_delta
        if self.leases and self.cost_learn:
            # The router chooses each turn's path by the costs it learns (router/plan.py), so
            # it offers every peer source that gains a block and lets the cost decide. A
            # threshold from the idle calibration hid that path from what it learns: in the
            # mixed-waits rerun (2026-12-06) it was 160 tokens, more than most turns' answer,
            # so no peer source was offered and tiered-adaptive read its own copy of the
            # previous prompt and recomputed the answer host-p2p read (1.044x its TTFT there).
            delta = cost.block_size
        spec = self.with_thresholds(rec.kv_recompute_threshold, delta)
        if self.leases:
            return spec.model_copy(update={"cost_model": cost})
        if waits and self.device_retention:
            choice = self.adaptive_ttl(cost, waits)
            spec = spec.with_ttl(choice.ttl_s) if choice.retain else spec.without_retention()
        return spec

    def without_retention(self) -> StrategySpec:
        """The same strategy with the decode node keeping nothing after a turn."""
        return self.model_copy(update={"device_retention": False, "decode_ttl_s": None,
                                       "dp_reuse": False, "leases": False})

    def without_host_copy(self) -> StrategySpec:
        """The same strategy with no host tier (its ``KVTierConnector`` configs dropped, no
        peer fetch, no indexer): a device copy or a recompute are the only ways to reuse.
        For an adaptive strategy with leases the router then prices releasing a turn
        against recomputing it, not against a host read."""
        keep = tuple(n for n in self.kv_configs
                     if load_config_file(n).get("kv_connector") != "KVTierConnector")
        return StrategySpec.model_validate({
            **self.model_dump(), "kv_configs": keep, "host_tier": False, "peer_fetch": False,
            "use_indexer": False, "host_bytes": None, "min_cached_token_delta": 0})

    @property
    def host_copy(self) -> bool:
        """A host tier keeps a copy of every turn that a next prefill can fetch."""
        return self.host_tier and self.peer_fetch

    @property
    def adaptive_retention(self) -> bool:
        """The router chooses each turn's device hold online (leases + a cost model)."""
        return bool(self.adaptive and self.leases and self.cost_model is not None
                    and "dp_read" in self.cost_model.reads)

    def adaptive_ttl(self, cost: CostModel, waits: Sequence[WaitSample]) -> TtlChoice:
        """The cost model's device TTL for these waits (a ``TtlChoice``)."""

        return choose_device_ttl(cost, waits, host_copy=self.host_copy,
                                 horizon_s=self.retention_horizon_s)

    def with_host_bytes(self, host_bytes: int | None) -> StrategySpec:
        """The same strategy with another host tier size (no-op without a host tier: kvtier's
        or vLLM's CPU offloading)."""
        if not (self.host_tier or self.vllm_offload) or host_bytes is None:
            return self
        return self.model_copy(update={"host_bytes": int(host_bytes)})

    def topology(self, prefill: int, decode: int) -> StrategySpec:
        return StrategySpec.model_validate({**self.model_dump(), "prefill": prefill,
                                            "decode": decode})

    def single(self) -> StrategySpec:
        """The same strategy on one engine per run (module docstring): its NIXL connector
        dropped (nothing moves between processes), no peer fetch and no indexer (one engine
        has no peer), the engine's host tier or vLLM's offloading serving its own turns.
        Strategies that retain on a decode node are refused."""
        if self.device_retention:
            raise ValueError(
                f"{self.name} retains KV on a decode node; one engine per strategy runs "
                f"{', '.join(SINGLE_ENGINE_NAMES)}")
        keep = tuple(n for n in self.kv_configs
                     if load_config_file(n).get("kv_connector") not in NIXL_CONNECTORS)
        return StrategySpec.model_validate({
            **self.model_dump(), "kv_configs": keep, "peer_fetch": False, "use_indexer": False,
            "min_cached_token_delta": 0, "prefill": 1, "decode": 0, "single_engine": True})

    # -- what the live runner starts ------------------------------------------------------
    def kv_transfer_config(self, nixl_buffer_device: str | None = None) -> dict | None:
        """The ``--kv-transfer-config`` of every instance, with this strategy's knobs set
        (None: no connector, ``recompute`` on one engine).

        The knobs go through the connectors' config types (``NixlKnobs``,
        ``ParamsFeedConfig``, ``HostTierConfig``), and each child's config is validated
        whole, so a misspelt key fails here rather than in a serving engine.
        ``nixl_buffer_device``: NixlConnector's ``kv_buffer_device`` instead of the files'
        (``cpu``); on CUDA the live runner passes ``cuda`` (a CPU buffer's D->P read never
        answered on the lent GPU, ``benchmarks/gpu/pd_bench.sh``)."""
        children = [copy.deepcopy(load_config_file(n)) for n in self.kv_configs]
        for c in children:
            extra = c.setdefault("kv_connector_extra_config", {})
            if c.get("kv_connector") in NIXL_CONNECTORS and nixl_buffer_device:
                c["kv_buffer_device"] = nixl_buffer_device
            if c.get("kv_connector") == "OffloadingConnector":
                if self.host_bytes is not None:
                    extra["cpu_bytes_to_use"] = int(self.host_bytes)
            elif c.get("kv_connector") in NIXL_CONNECTORS:
                retain = self.device_retention
                _apply(extra, NixlKnobs(
                    bidirectional_kv_xfer=retain,
                    decoder_kv_blocks_ttl=_ttl_value(self.decode_ttl_s) if retain else None,
                    kv_recompute_threshold=self.kv_recompute_threshold if retain else None,
                ).model_dump())
                if c["kv_connector"] == "KVTierNixlConnector":
                    feed = ParamsFeedConfig.from_extra_config(extra)
                    if "decode_lease_s" in feed.model_fields_set:
                        # the node's default lease (the router asks for its own on every leg)
                        _apply(extra, ParamsFeedConfig(
                            decode_lease_s=self.decode_lease_s).model_dump(exclude_unset=True))
            elif c.get("kv_connector") == "KVTierConnector":
                tier = HostTierConfig(peer_fetch=self.peer_fetch, kv_events=self.host_tier,
                                      min_cached_token_delta=self.min_cached_token_delta)
                if self.host_bytes is not None:
                    tier = HostTierConfig(**tier.model_dump(exclude_unset=True),
                                          cpu_bytes_to_use=int(self.host_bytes))
                _apply(extra, tier.model_dump(exclude_unset=True))
                HostTierConfig.from_extra_config(extra)  # the file's keys and ours, whole
        if len(children) <= 1:
            return children[0] if children else None
        return {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"connectors": children}}

    def router_settings(self) -> dict:
        """RouterConfig fields this strategy sets (instances/indexer URL, and each decode
        instance's ``lease`` endpoint, come from the run). With leases: the lease the router
        asks for, and -- adaptive with a cost model -- ``retention: adaptive`` with the cost
        model and whether a host copy exists (the hold is priced against reading it instead
        of recomputing); without a cost model the router renews while it keeps a turn."""
        out: dict = {"min_cached_token_delta": self.min_cached_token_delta}
        if self.device_retention:
            ttl = float(self.decode_ttl_s)  # type: ignore[arg-type]
            out["decode_kv_ttl_s"] = ttl
            # Expire the router's entry before D frees the blocks, early enough for a read
            out["ttl_margin_s"] = router_ttl_margin_s(ttl)
        if self.leases:
            out["decode_lease_s"] = self.decode_lease_s
            out["host_copy"] = self.host_copy
            if self.adaptive_retention:
                out["retention"] = "adaptive"
                out["hold_horizon_s"] = self.retention_horizon_s
                out["cost_model"] = self.cost_model.model_dump()  # type: ignore[union-attr]
                out["cost_refit"] = self.cost_refit
                # decide from what each path really cost, and price holds by decode pressure
                out["cost_learn"] = self.cost_learn
                out["hold_pressure"] = self.hold_pressure
        return out


def _apply(extra: dict, values: dict[str, Any]) -> None:
    """Set a connector config's keys from a config type's dump; None removes a key."""
    for k, v in values.items():
        if v is None:
            extra.pop(k, None)
        else:
            extra[k] = v


def _ttl_value(ttl: float | None) -> int:
    # vLLM compares the TTL with perf_counter seconds; whole seconds keep the
    # config readable and match its documented default (480).
    return max(1, round(float(ttl or 0)))


def builtin(name: str, decode_ttl_s: float | None = None) -> StrategySpec:
    """One of the named strategies; ``decode_ttl_s`` overrides the device TTL."""
    if name not in _BUILTIN:
        raise ValueError(f"unknown strategy {name!r}; known: "
                         f"{', '.join(STRATEGY_NAMES + GPU_STRATEGY_NAMES)}")
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
        description="tiered with thresholds from the cost model; the router holds or releases "
                    "each turn's device KV online (decode leases, per conversation and turn)",
        kv_configs=("nixl-bidirectional-lease", "kvtier-peer"), device_retention=True,
        decode_ttl_s=VLLM_DEFAULT_TTL_S, dp_reuse=True, host_tier=True, peer_fetch=True,
        use_indexer=True, adaptive=True, leases=True, min_cached_token_delta=64,
        cost_learn=True, hold_pressure=True),
    "vllm-offload": StrategySpec(
        name="vllm-offload",
        description="vLLM's own CPU offloading (OffloadingConnector, prompt and generated "
                    "tokens) on every instance, NixlConnector P->D; no kvtier component in "
                    "the engines (GPU only)",
        kv_configs=("nixl-unidirectional", "vllm-offload-cpu"), device_retention=False,
        vllm_offload=True),
}
