"""Fit a `CostModel` to the turns of live runs (in-sample calibration for `kvtier ab`/`calibrate`).

- **Service time, not TTFT.** A live TTFT that overlapped other prefills includes time batched
  with them (vLLM's chunked prefill shares each step), and the simulator adds its own queueing,
  so fitting raw TTFTs would count contention twice. Each turn's service time is its TTFT under
  processor sharing (`service_times`).
- **One joint fit** over every turn: ``service = a + b·new + c·new·(cached + new/2)`` plus, for a
  turn that read over path ``p`` (``dp_read``, ``p2p``), ``setup_p + bytes/bandwidth_p`` — the
  read's cost is whatever the service time holds beyond the prefill of the computed tokens on
  top of the reused ones (router, indexer, handshake and transfer), which is what the
  simulator's ``read_s`` stands for. Non-negative, relative least squares. A path no turn took
  borrows the other path's link, or FACTS.md's NIXL-on-CPU figure; every choice is written
  into ``CostModel.fit_notes``.
- **Decode**: ``(e2e - ttft) / response tokens``, median.

Threading model: pure functions.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence

import numpy as np

from kvtier.ab.records import RunResult, TurnRecord
from kvtier.cost.model import CostModel, LinkModel, _nnls_small

READ_PATHS = ("dp_read", "p2p")
# FACTS.md: NIXL/UCX DRAM->DRAM between two processes here, ~4 GB/s
NIXL_CPU_PRIOR = LinkModel(setup_s=0.002, bytes_per_s=4e9)
UNBOUNDED_BPS = 1e15  # a fitted bandwidth term of zero: reading costs only its setup


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
    notes: list[str] = []
    turns: list[tuple[TurnRecord, float]] = []  # (turn, its processor-sharing service time)
    for r in results:
        svc = service_times(r)
        turns += [(t, svc[(t.conversation_id, t.turn)]) for t in r.ok_turns
                  if (t.conversation_id, t.turn) in svc]
    # One joint least-squares fit over every turn: service = a + b·new + c·new·(cached + new/2)
    # + [took path p]·(setup_p + bytes/bandwidth_p). Fitting prefill on no-reuse turns alone
    # would extrapolate from (long new, no cache) to (short new, long cache), where agentic
    # follow-ups live; the joint fit sees both.
    rows, ys = [], []
    for t, svc in turns:
        if svc <= 0 or t.computed_tokens <= 0:
            continue
        n, k = float(t.computed_tokens), float(t.reused_tokens)
        row = [1.0, n, n * (k + n / 2)]
        for path in READ_PATHS:
            took = t.reuse_path == path and t.reused_tokens > 0
            row += [1.0 if took else 0.0, k * kv_bytes_per_token if took else 0.0]
        rows.append(row)
        ys.append(svc)
    if len(rows) < 3:
        raise ValueError(f"need at least 3 turns with computed tokens, got {len(rows)}")
    x, y = np.array(rows), np.array(ys)
    coef = _nnls_small(x / y[:, None], np.ones_like(y))  # relative error, like fit_prefill
    a, b, c = (float(v) for v in coef[:3])
    notes.append(f"joint fit over {len(rows)} turns (service time under processor sharing of "
                 f"overlapping prefills; relative least squares, all coefficients >= 0)")
    base = CostModel(kv_bytes_per_token=kv_bytes_per_token, prefill_a_s=a,
                     prefill_b_s_per_token=b, prefill_c_s_per_token_ctx=c, block_size=block_size)
    links: dict[str, LinkModel] = {}
    for i, path in enumerate(READ_PATHS):
        used = int(x[:, 3 + 2 * i].sum())
        if not used:
            notes.append(f"{path}: no turn took this path")
            continue
        setup, per_byte = float(coef[3 + 2 * i]), float(coef[4 + 2 * i])
        bw = 1.0 / per_byte if per_byte > 0 else UNBOUNDED_BPS
        links[path] = LinkModel(setup_s=setup, bytes_per_s=bw)
        notes.append(f"{path}: {used} turns; setup {setup * 1e3:.0f} ms, "
                     + (f"{bw / 1e9:.3g} GB/s" if per_byte > 0 else
                        "no size-dependent cost found (bandwidth unbounded)"))
    for path in READ_PATHS:
        if path not in links:
            other = next((p for p in READ_PATHS if p in links), None)
            links[path] = links[other] if other else NIXL_CPU_PRIOR
            notes.append(f"{path}: borrowed from {other}" if other else
                         f"{path}: FACTS.md prior (setup 2 ms, 4 GB/s), nothing measured")
    every = [t for t, _ in turns]
    tpot = [(t.e2e_s - t.ttft_s) / t.response_tokens for t in every if t.response_tokens > 1]
    return base.model_copy(update={
        "reads": links, "fit_notes": tuple(notes),
        "decode_s_per_token": max(0.0, statistics.median(tpot)) if tpot else 0.0})
