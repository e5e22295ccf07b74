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

Threading model: pure functions.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence

from kvtier.ab.records import RunResult
from kvtier.cost.fit import ServiceSample, fit_turns
from kvtier.cost.model import CostModel


def service_times(result: RunResult) -> dict[tuple[str, int], float]:
    """Each turn's prefill service time under processor sharing: over its prefill interval
    ``[t_start, t_start + ttft]``, every instant counts ``1/n`` where ``n`` prefill intervals of
    the run are active then. vLLM's chunked prefill batches concurrent prompts into one step, so
    a turn that overlapped another for its whole life did about half the work its TTFT shows;
    a turn that ran alone keeps its whole TTFT. (One prefill instance assumed, as the local stack.)"""
    ok = [t for t in result.ok_turns if t.ttft_s > 0]
    edges = sorted({x for t in ok for x in (t.t_start, t.t_start + t.ttft_s)})
    out: dict[tuple[str, int], float] = {}
    for t in ok:
        a0, a1 = t.t_start, t.t_start + t.ttft_s
        total = 0.0
        for lo, hi in itertools.pairwise(edges):
            if hi <= a0 or lo >= a1:
                continue
            mid = (lo + hi) / 2
            n = sum(1 for u in ok if u.t_start <= mid < u.t_start + u.ttft_s)
            total += (min(hi, a1) - max(lo, a0)) / max(1, n)
        out[(t.conversation_id, t.turn)] = total
    return out


def fit_from_records(results: Sequence[RunResult], kv_bytes_per_token: int,
                     block_size: int) -> CostModel:
    """The cost model of these runs: ``kvtier.cost.fit.fit_turns`` over every turn's service
    time, plus the decode time per token."""
    samples: list[ServiceSample] = []
    for r in results:
        svc = service_times(r)
        samples += [ServiceSample(t.computed_tokens, t.reused_tokens, t.reuse_path,
                                  svc[(t.conversation_id, t.turn)])
                    for t in r.ok_turns if (t.conversation_id, t.turn) in svc]
    model = fit_turns(samples, kv_bytes_per_token, block_size)
    every = [t for r in results for t in r.ok_turns]
    tpot = [(t.e2e_s - t.ttft_s) / t.response_tokens for t in every if t.response_tokens > 1]
    return model.model_copy(update={
        "fit_notes": (*model.fit_notes, "service time = TTFT under processor sharing of "
                      "overlapping prefills"),
        "decode_s_per_token": max(0.0, statistics.median(tpot)) if tpot else 0.0})
