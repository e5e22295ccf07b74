"""Fit a `CostModel` to the turns of live runs (in-sample calibration for `kvtier ab`/`calibrate`).

- **Service time, not TTFT.** A live TTFT that overlapped other prefills includes time batched
  with them (vLLM's chunked prefill shares each step), and the simulator adds its own queueing,
  so fitting raw TTFTs would count contention twice. Each turn's service time is its TTFT under
  processor sharing (`service_times`).
- **One joint fit** over every turn, ``kvtier.cost.fit.fit_turns`` (the one way kvtier fits a
  cost model): a read's cost is whatever the service time holds beyond the prefill of the
  computed tokens on top of the reused ones (router, indexer, handshake and transfer), which
  is what the simulator's ``read_s`` stands for.
- **Decode**: ``(e2e - ttft) / response tokens``, median.
- **A shared host** (`fit_shared_host`): on the local CPU stack every engine runs on one
  machine, and a prefill overlapping a running decode was measured 2-3x slower than one
  alone (the decode-scarce run of 2026-12-04), which the fleet model does not have when
  instances are separate machines. There each turn's service time also divides out
  ``1 + decode_interference`` while a decode is busy (`service_times`), and the interference
  is chosen from a grid as the value whose joint fit explains the turns best (lowest
  log RMS error). The simulator applies it back (``FleetSpec.decode_interference``).

Threading model: pure functions.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.ab.records import RunResult
from kvtier.cost.fit import ServiceSample, fit_turns
from kvtier.cost.model import CostModel

# Candidate slowdowns of a prefill per busy decode instance on a shared host (0: none).
INTERFERENCE_GRID: tuple[float, ...] = tuple(i / 8 for i in range(33))  # 0 .. 4


def service_times(result: RunResult, decode_interference: float = 0.0,
                  decode_instances: int = 1) -> dict[tuple[str, int], float]:
    """Each turn's prefill service time under processor sharing: over its prefill interval
    ``[t_start, t_start + ttft]``, every instant counts ``1/n`` where ``n`` prefill intervals of
    the run are active then. vLLM's chunked prefill batches concurrent prompts into one step, so
    a turn that overlapped another for its whole life did about half the work its TTFT shows;
    a turn that ran alone keeps its whole TTFT. (One prefill instance assumed, as the local stack.)

    With ``decode_interference`` β > 0 (engines sharing one host), an instant also counts
    ``1/(1 + β·k)``, ``k`` the decode instances busy then: turns whose decode interval
    ``[t_start + ttft, t_start + e2e]`` is open, at most ``decode_instances``."""
    if decode_interference < 0:
        raise ValueError(f"decode_interference must be >= 0, got {decode_interference}")
    ok = [t for t in result.ok_turns if t.ttft_s > 0]
    # a sweep over the interval ends: +-1 prefills (kind 0) and busy decodes (kind 1)
    steps: list[tuple[float, int, int]] = [(t.t_start, 0, 1) for t in ok]
    steps += [(t.t_start + t.ttft_s, 0, -1) for t in ok]
    if decode_interference > 0:
        for t in ok:
            if t.e2e_s > t.ttft_s:
                steps += [(t.t_start + t.ttft_s, 1, 1), (t.t_start + t.e2e_s, 1, -1)]
    steps.sort()
    # integral[x] = the service a turn active over (-inf, x] would have had
    integral: dict[float, float] = {}
    n = busy = 0
    acc, prev = 0.0, None
    for x, kind, delta in steps:
        if prev is not None and x > prev and n > 0:
            k = min(decode_instances, busy)
            acc += (x - prev) / (n * (1.0 + decode_interference * k))
        integral[x] = acc
        prev = x
        if kind == 0:
            n += delta
        else:
            busy += delta
    return {(t.conversation_id, t.turn): integral[t.t_start + t.ttft_s] - integral[t.t_start]
            for t in ok}


def _samples(results: Sequence[RunResult], decode_interference: float,
             decode_instances: int) -> list[ServiceSample]:
    samples: list[ServiceSample] = []
    for r in results:
        svc = service_times(r, decode_interference, decode_instances)
        samples += [ServiceSample(t.computed_tokens, t.reused_tokens, t.reuse_path,
                                  svc[(t.conversation_id, t.turn)])
                    for t in r.ok_turns if (t.conversation_id, t.turn) in svc]
    return samples


def fit_from_records(results: Sequence[RunResult], kv_bytes_per_token: int,
                     block_size: int, decode_interference: float = 0.0,
                     decode_instances: int = 1) -> CostModel:
    """The cost model of these runs: ``kvtier.cost.fit.fit_turns`` over every turn's service
    time (``decode_interference`` taken out, see `service_times`), plus the decode time per
    token."""
    return _with_decode(fit_turns(_samples(results, decode_interference, decode_instances),
                                  kv_bytes_per_token, block_size), results)


def _with_decode(model: CostModel, results: Sequence[RunResult]) -> CostModel:
    """``model`` (a prefill fit of ``results``) with their decode time per token."""
    every = [t for r in results for t in r.ok_turns]
    tpot = [(t.e2e_s - t.ttft_s) / t.response_tokens for t in every if t.response_tokens > 1]
    return model.model_copy(update={
        "fit_notes": (*model.fit_notes, "service time = TTFT under processor sharing of "
                      "overlapping prefills"),
        "decode_s_per_token": max(0.0, statistics.median(tpot)) if tpot else 0.0})


def log_rms_error(cost: CostModel, samples: Sequence[ServiceSample]) -> float:
    """How well ``cost`` explains ``samples``: the RMS of log(predicted / measured), the
    joint fit's own objective (`kvtier.cost.fit`). A sample predicts as the fit's row does:
    the prefill of its computed tokens on top of its reused ones, plus the read of those over
    its path (none for ``local``/``none``)."""
    errs = []
    for s in samples:
        if s.seconds <= 0 or s.computed_tokens <= 0:
            continue
        read = cost.read_s(s.path, s.reused_tokens) if s.path in cost.reads else 0.0
        predicted = read + cost.prefill_s(s.computed_tokens, s.reused_tokens)
        errs.append(math.log(max(predicted, 1e-12) / s.seconds))
    if not errs:
        raise ValueError("no sample with computed tokens and positive seconds")
    return math.sqrt(sum(e * e for e in errs) / len(errs))


@dataclass(frozen=True)
class SharedHostFit:
    cost: CostModel
    decode_interference: float  # a prefill's slowdown per busy decode instance (β)
    log_rms: float  # of the chosen fit (`log_rms_error`)
    tried: tuple[tuple[float, float], ...]  # (β, log RMS error) for every candidate


def fit_shared_host(results: Sequence[RunResult], kv_bytes_per_token: int, block_size: int,
                    decode_instances: int = 1,
                    grid: Sequence[float] = INTERFERENCE_GRID) -> SharedHostFit:
    """The cost model and decode interference of runs on one shared host (the local stack):
    for each β of ``grid``, the prefill fit with β taken out (as `fit_from_records`); the β
    whose fit has the lowest log RMS error wins (ties: the smaller β)."""
    if not grid:
        raise ValueError("empty interference grid")
    best: tuple[float, float, CostModel] | None = None
    tried: list[tuple[float, float]] = []
    for beta in sorted(grid):
        samples = _samples(results, beta, decode_instances)
        cost = fit_turns(samples, kv_bytes_per_token, block_size)
        err = log_rms_error(cost, samples)
        tried.append((beta, err))
        if best is None or err < best[1] - 1e-12:
            best = (beta, err, cost)
    assert best is not None
    beta, err, prefill_fit = best
    model = _with_decode(prefill_fit, results)
    note = (f"shared host: a prefill runs 1/(1 + {beta:g}·k) as fast while k decode instances "
            f"are busy (chosen from {len(tried)} values by the fit's log RMS error, "
            f"{err:.3f}; {dict(tried).get(0.0, float('nan')):.3f} without it)")
    model = model.model_copy(update={"fit_notes": (*model.fit_notes, note)})
    return SharedHostFit(model, beta, err, tuple(tried))
