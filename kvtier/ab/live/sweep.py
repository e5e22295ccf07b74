"""The live sweep of ``kvtier ab``: run each strategy in turn on the same trace.

A strategy that fails (its stack does not start, a turn errors out) is logged
and recorded, and the sweep goes on with the next one, so one fault never
loses the runs that finished; Ctrl-C stops the sweep and keeps what finished.
``tiered-adaptive`` is configured from the cost model (given, or fitted to the
strategies that ran before it): its thresholds, and -- with decode leases -- the cost model
its router decides each turn's device hold with; without leases, also its device TTL from
the tool waits those runs observed.

Threading model: runs on the caller's thread; each ``run_one`` owns its helpers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.ab.fit import fit_from_records
from kvtier.ab.records import RunResult, merge_repeats
from kvtier.ab.strategies import StrategySpec
from kvtier.ab.traces import Trace
from kvtier.cost.model import CostModel
from kvtier.cost.retention import observed_waits

log = logging.getLogger("kvtier.ab")

RunOne = Callable[[StrategySpec, Trace], RunResult]


@dataclass
class Sweep:
    results: list[RunResult] = field(default_factory=list)
    ran: list[StrategySpec] = field(default_factory=list)  # as run: adaptive ones carry knobs
    failed: dict[str, str] = field(default_factory=dict)  # strategy -> why it has no results
    adaptive: dict[str, dict] = field(default_factory=dict)
    interrupted: bool = False
    repeats_done: int = 0  # complete rounds reported (fewer than asked when interrupted)


def configure_adaptive(s: StrategySpec, cost: CostModel | None, done: Sequence[RunResult],
                       kvbpt: int, block_size: int, time_scale: float
                       ) -> tuple[StrategySpec, dict | None]:
    """``s`` with thresholds (and, with device retention, the TTL) from the cost model."""
    c = cost
    if c is None and done:
        c = fit_from_records(list(done), kvbpt, block_size)
    if c is None:
        return s, None
    waits = observed_waits([t for r in done for t in r.turns], time_scale)
    choice = (s.adaptive_ttl(c, waits) if waits and s.device_retention and not s.leases
              else None)
    s = s.with_cost_model(c, waits)
    info = {"kv_recompute_threshold": s.kv_recompute_threshold,
            "min_cached_token_delta": s.min_cached_token_delta,
            "device_retention": s.device_retention,
            "decode_ttl_s": s.decode_ttl_s, "recommendation": c.recommend().explanation}
    if s.leases:
        # the router chooses each turn's hold online; the TTL is only its upper bound
        info.update(leases=True, retention="adaptive" if s.adaptive_retention else "renew",
                    host_copy=s.host_copy, decode_lease_s=s.decode_lease_s,
                    cost_refit=s.cost_refit,
                    ttl_choice="device hold chosen online by the router per conversation and "
                               "turn (decode leases; vLLM's TTL is the upper bound)")
    if choice is not None:
        info["ttl_choice"] = choice.explanation
    log.info("%s: from the cost model: kv_recompute_threshold=%d min_cached_token_delta=%d "
             "decode_ttl_s=%s (%s)", s.name, s.kv_recompute_threshold, s.min_cached_token_delta,
             s.decode_ttl_s, info.get("ttl_choice", "no waits observed"))
    return s, info


def run_sweep(specs: Sequence[StrategySpec], trace: Trace, run_one: RunOne, *,
              cost: CostModel | None, kvbpt: int, block_size: int, time_scale: float,
              log_dir: Path | None = None, repeats: int = 1) -> Sweep:
    """Run every strategy ``repeats`` times, interleaved and rotated (A B C, B C A, C A B: slow
    drift of a shared machine and the position in the sweep land on every strategy alike), and
    merge each one's repeats
    (`kvtier.ab.records.merge_repeats`). An adaptive strategy is configured once, before its
    first run, and keeps that configuration in later repeats. A strategy that fails in any
    repeat is dropped from the results (its other repeats would not be comparable). Interrupted
    (Ctrl-C, SIGTERM: a time limit), the rounds every strategy completed are reported and the
    unfinished one is left out (``repeats_done``)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    sw = Sweep()
    runs: dict[str, list[RunResult]] = {}
    configured: dict[str, StrategySpec] = {}
    done: list[RunResult] = []
    for rep in range(repeats):
        # Repeat k > 0 starts k places further along the list (A B C, B C A, C A B): a
        # strategy's position -- right after a heavy one, last in the sweep -- is not a
        # constant of its numbers.
        k = rep % len(specs) if specs else 0
        for s in [*specs[k:], *specs[:k]]:
            if s.name in sw.failed:
                continue
            if s.adaptive and s.name not in configured:
                s, info = configure_adaptive(s, cost, done, kvbpt, block_size, time_scale)
                if info is not None:
                    sw.adaptive[s.name] = info
                configured[s.name] = s
            s = configured.get(s.name, s)
            label = f"{s.name} (repeat {rep + 1}/{repeats})" if repeats > 1 else s.name
            try:
                result = run_one(s, trace)
            except KeyboardInterrupt:
                log.warning("interrupted during %s; reporting the strategies that finished "
                            "every repeat", label)
                sw.failed[s.name] = "interrupted"
                sw.interrupted = True
                break
            except Exception as e:  # one strategy's fault must not lose the others
                where = f" (its logs: {log_dir / s.name})" if log_dir else ""
                log.exception("strategy %s failed: %s: %s%s; going on with the rest",
                              label, type(e).__name__, e, where)  # noqa: TRY401 - cause first, then traceback
                sw.failed[s.name] = f"{type(e).__name__}: {e}"
                continue
            done.append(result)
            runs.setdefault(s.name, []).append(result)
            if rep == 0:
                sw.ran.append(s)
        if sw.interrupted:
            break
    # Interrupted: every strategy that did not fail keeps the rounds all of them completed
    # (an unfinished last round is left out for all alike, so the repeats stay paired).
    alive = [s.name for s in specs
             if sw.failed.get(s.name, "interrupted").startswith("interrupted")]
    sw.repeats_done = min((len(runs.get(n, ())) for n in alive), default=0)
    if sw.interrupted and sw.repeats_done > 0:
        for n in alive:
            runs[n] = runs[n][:sw.repeats_done]
            sw.failed.pop(n, None)
    for s in specs:
        got = len(runs.get(s.name, ()))
        if s.name not in sw.failed and 0 < got < repeats and not sw.interrupted:
            sw.failed[s.name] = f"interrupted after {got} of {repeats} repeats"
    # `ran` and `results` stay index for index (the report simulates `ran`): every strategy
    # that finished all its repeats, in the order given.
    order = {s.name: i for i, s in enumerate(specs)}
    sw.ran = sorted((s for s in sw.ran if s.name not in sw.failed), key=lambda s: order[s.name])
    sw.results = [merge_repeats(runs[s.name]) for s in sw.ran]
    return sw
