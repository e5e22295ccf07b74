"""Answers built from one index lookup: per-pod matches and the pull source.

Pure functions over the index's raw answer (``{(stream id, tier): blocks}``),
so ``/v1/lookup``, ``/v1/source`` and ``/v1/route`` share one hashing and one
walk of the index, and the rules below are testable without sockets.

- **Merge.** A pod's streams (``NAME``, ``NAME#S``) are one pod: per (pod,
  tier) the longest prefix any of its streams holds.
- **Source** (after llm-d's P2P pull rule): only CPU-tier copies can be
  pulled; a candidate is another pod than the target, has a P2P address and
  is *offered* (not stale: see ``kvtier.indexer.subscriber``); it must gain
  enough over what the target holds on any tier, by the one reuse gate
  (``kvtier.reuse_gate.gains_enough`` with ``min_delta``), the rule the router
  and the engine's host tier apply too. Without a target the best candidate
  is returned ungated: the caller (the router) gates it for the pod it picks.
  Among candidates, those within one block of the longest are equally good
  and the least loaded of them wins (``loads``: in-flight requests per pod,
  absent = 0); then the longest, then the pod name. Equal input, equal answer.

With the compiled helper (``kvtier.indexer.native``), ``route_parts`` does the
per-holder loops of ``matches`` and ``choose_source`` in one C pass (the same
answers: tests compare); ``choose_source`` then looks only at the CPU-tier
candidates it returns.

Threading model: pure functions, no state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MemberDescriptorType

from kvtier.ids import PodId, Tier
from kvtier.indexer.config import STREAM_SEP, pod_of
from kvtier.indexer.index import Holder
from kvtier.indexer.native import NATIVE
from kvtier.reuse_gate import gains_enough
from kvtier.wire.indexer_api import Match, Source

_TIER_VALUE = {t: t.value for t in Tier}
_native_rows = getattr(NATIVE, "route_rows", None)


def _match_slots() -> tuple[object, ...] | None:
    """``Match``'s field descriptors, so the helper can make one without calling it (a
    frozen msgspec struct's ``__init__`` only sets them); None: it calls ``Match``."""
    names = getattr(Match, "__struct_fields__", None)
    d = tuple(Match.__dict__.get(n) for n in names or ())
    ok = names == ("pod", "tier", "matched_tokens") and not getattr(
        Match, "__post_init__", None) and all(isinstance(x, MemberDescriptorType) for x in d)
    return d if ok else None


_MATCH_SLOTS = _match_slots()


@dataclass(frozen=True, slots=True)
class SourceChoice:
    source: Source | None
    target_matched_tokens: int
    delta: int


def merge_streams(found: Mapping[Holder, int]) -> dict[Holder, int]:
    """``{(stream id, tier): n}`` -> ``{(pod, tier): n}``, the longest of a pod's streams."""
    out: dict[Holder, int] = {}
    for (stream, tier), n in found.items():
        key = (pod_of(stream), tier) if STREAM_SEP in stream else (stream, tier)
        if n > out.get(key, 0):
            out[key] = n
    return out


def matches(merged: Mapping[Holder, int], block_size: int) -> list[Match]:
    """Longest first, then pod, then tier; zero matches omitted."""
    # Plain tuples sort natively (no key function): at 512 holders this is ~3x faster.
    tv = _TIER_VALUE   # Enum.value is a slow property: 512 of them cost ~40 µs
    rows = [(-n, p, tv[t]) for (p, t), n in merged.items() if n > 0]
    rows.sort()
    return [Match(p, t, -neg * block_size) for neg, p, t in rows]  # type: ignore[arg-type]


def route_parts(merged: Mapping[Holder, int], block_size: int, target_pod: PodId | None,
                ) -> tuple[list[Match], int, list[tuple[PodId, int]]]:
    """``(matches(merged), blocks target_pod holds (its longest tier), CPU-tier holders
    other than the target: [(pod, blocks)])``: what ``/v1/route`` needs from ``merged``."""
    if _native_rows is not None and type(merged) is dict:
        got = _native_rows(merged, block_size, target_pod, _TIER_VALUE, Tier.CPU, Match,
                           _MATCH_SLOTS)
        if got is not None:
            return got
    return (matches(merged, block_size), *_target_and_cpu(merged, target_pod))


def choose_source(merged: Mapping[Holder, int], block_size: int, target_pod: PodId | None,
                  min_delta: int, p2p_of: Callable[[PodId], tuple[str, int] | None],
                  offered: Callable[[PodId], bool],
                  loads: Mapping[str, int] | None = None) -> SourceChoice:
    """The pod to pull this prompt's KV from into ``target_pod`` (None: a target that holds
    nothing), or none. ``p2p_of``/``offered`` are asked only about CPU-tier holders."""
    target, cpu = _target_and_cpu(merged, target_pod)
    return choose_among(cpu, target, block_size, target_pod, min_delta, p2p_of, offered, loads)


def _target_and_cpu(merged: Mapping[Holder, int], target_pod: PodId | None,
                    ) -> tuple[int, list[tuple[PodId, int]]]:
    target = 0
    if target_pod is not None:
        target = max((n for (p, _), n in merged.items() if p == target_pod), default=0)
    return target, [(p, n) for (p, t), n in merged.items()
                    if t is Tier.CPU and p != target_pod and n > 0]


def choose_among(cpu: list[tuple[PodId, int]], target_blocks: int, block_size: int,
                 target_pod: PodId | None, min_delta: int,
                 p2p_of: Callable[[PodId], tuple[str, int] | None],
                 offered: Callable[[PodId], bool],
                 loads: Mapping[str, int] | None = None) -> SourceChoice:
    """``choose_source`` given ``route_parts``' target blocks and CPU-tier holders."""
    target = target_blocks * block_size
    cands: list[tuple[int, PodId, tuple[str, int]]] = []
    for p, n in cpu:
        addr = p2p_of(p)
        if addr is None or not offered(p):
            continue
        cands.append((n * block_size, p, addr))
    if not cands:
        return SourceChoice(None, target, 0)
    best = max(c[0] for c in cands)
    load = loads or {}
    near = [c for c in cands if c[0] >= best - block_size]
    tokens, pod, (host, port) = min(near, key=lambda c: (load.get(c[1], 0), -c[0], c[1]))
    delta = tokens - target
    # Without a target (``/v1/route`` as the router asks it) this is a candidate: the router
    # gates it, once, against the prefill it picks. With one, the same gate answers here.
    if target_pod is not None and not gains_enough(delta, min_delta):
        return SourceChoice(None, target, delta)
    return SourceChoice(Source(pod=pod, tier="CPU", matched_tokens=tokens, p2p_host=host,
                               p2p_port=port), target, delta)
