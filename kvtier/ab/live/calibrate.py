"""``kvtier calibrate``: fit the cost model (``kvtier.cost.model.CostModel``) and print the
thresholds it recommends; ``--out FILE`` writes the fitted model as JSON (what ``kvtier ab
--cost`` and the cost-aware connector read).

Three ways to get the turns it fits:

- default: a local 1P1D stack runs the calibration sweep (``calibration_trace``) through
  the ``recompute``, ``device-ttl`` and ``host-p2p`` strategies, one request at a time, so
  every TTFT is one prefill's cost (``kvtier.ab.live.runner``, ``sequential``);
- ``--stack ROUTER_URL``: the same sweep against a running router, 1-token turns, latency
  as TTFT;
- ``--simulate``: the sweep through the simulator with the built-in prior, which the fit
  must recover (a check of the fit itself).

Threading model: runs on the caller's thread (the runner owns its helper threads).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from kvtier.ab.fit import fit_from_records
from kvtier.ab.live.common import (
    model_facts,
    prior_cost_model,
    quiet_http_logs,
    resolve_model,
    sim_fleet,
)
from kvtier.ab.records import RunResult, TurnRecord
from kvtier.ab.simulator import simulate_all
from kvtier.ab.strategies import parse_list
from kvtier.ab.traces import ConversationSpec, Trace, TurnSpec, token_ids
from kvtier.ids import ConversationId, Outcome, ReusePath

# `kvtier calibrate` measures prefill (recompute), D->P reads (device-ttl) and peer reads
# (host-p2p) on the same sweep.
CALIBRATE_WITH = "recompute,device-ttl,host-p2p"


def calibration_trace(max_context: int, gap_s: float = 0.0) -> Trace:
    """Fresh prompts of growing size, each followed by turns that add growing deltas;
    conversation k starts at ``k * gap_s`` (the simulated calibration spaces them so no two
    prefills overlap; the live one runs them one after another)."""
    convs: list[ConversationSpec] = []
    sizes = [n for n in (64, 256, 512, 1024, 2048, 4096) if n * 2 < max_context]
    for k, n in enumerate(sizes):
        turns = [TurnSpec(n, 8, 0.0)]
        for d in (32, 128, 512):
            if n * 2 + d + 64 < max_context:
                turns.append(TurnSpec(d, 8, 0.0))
        convs.append(ConversationSpec(ConversationId(f"cal{k}"), k * gap_s, 1000 + k, turns))
    return Trace("calibration", 4096, convs)


def run_calibrate(args: argparse.Namespace) -> int:
    """``kvtier calibrate``: fit, print the fit and the recommended thresholds, write
    ``--out``."""
    quiet_http_logs()
    model_dir = resolve_model(args.model)
    kvbpt, max_ctx = model_facts(model_dir)
    max_ctx = min(max_ctx, args.max_model_len)
    trace = calibration_trace(max_ctx)
    if args.simulate:
        truth = prior_cost_model(kvbpt, args.block_size)
        results = simulate_all(calibration_trace(max_ctx, gap_s=1e4), parse_list(CALIBRATE_WITH),
                               sim_fleet(1, 1, args.block_size), truth)
        source = "simulated stack (built-in prior); the fit must recover it"
    elif args.stack:
        results = [_calibrate_against(args.stack, trace, Path(model_dir).name)]
        source = f"router at {args.stack} (TTFT = latency of 1-token turns)"
    else:
        from kvtier.ab.live.runner import RunOptions, run_strategy

        opts = RunOptions(model=str(model_dir), block_size=args.block_size, max_model_len=max_ctx,
                          kv_bytes_per_token=kvbpt, log_dir=Path(args.log_dir),
                          progress=not args.no_progress, sequential=True)
        results = [run_strategy(s, trace, opts) for s in parse_list(CALIBRATE_WITH)]
        source = (f"local 1P1D stack ({CALIBRATE_WITH} runs of a calibration sweep, "
                  f"one request at a time)")
    cost = fit_from_records(results, kvbpt, args.block_size)
    rec = cost.recommend()
    print(f"calibrated on: {source}")
    print(f"prefill_s(new, cached) = {cost.prefill_a_s * 1e3:.3g} ms + "
          f"{cost.prefill_b_s_per_token * 1e6:.3g} us*new + "
          f"{cost.prefill_c_s_per_token_ctx * 1e9:.3g} ns*new*(cached+new/2)")
    for p, link in cost.reads.items():
        print(f"read {p}: setup {link.setup_s * 1e3:.3g} ms, {link.bytes_per_s / 1e9:.3g} GB/s")
    print(f"recommended kv_recompute_threshold = {rec.kv_recompute_threshold}")
    print(f"recommended min_cached_token_delta = {rec.min_cached_token_delta}")
    print(rec.explanation)
    if args.out:
        Path(args.out).write_text(cost.model_dump_json(indent=2))
        print(f"cost model: {args.out}")
    return 0


def _calibrate_against(url: str, trace: Trace, model: str) -> RunResult:
    """Against a running router: 1-token turns, latency as TTFT (no leg split available)."""
    import httpx

    recs: list[TurnRecord] = []
    with httpx.Client(base_url=url.rstrip("/"), timeout=600) as c:
        for conv in trace.conversations:
            hist: list[int] = []
            for i, t in enumerate(conv.turns):
                prompt = [*hist, *token_ids(conv, i, t.new_tokens, trace.vocab_size)]
                t0 = time.perf_counter()
                r = c.post("/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                    "return_token_ids": True, "conversation_id": f"cal-{conv.conversation_id}"})
                dt = time.perf_counter() - t0
                r.raise_for_status()
                out = r.json()
                gen = out["choices"][0].get("token_ids") or []
                cached = ((out.get("usage") or {}).get("prompt_tokens_details") or {}).get(
                    "cached_tokens") or 0
                recs.append(TurnRecord("calibrate", conv.conversation_id, i, len(prompt), cached,
                                       ReusePath.LOCAL if cached else ReusePath.NONE,
                                       len(prompt) - cached, dt, dt, 0.0, 0.0, Outcome.NONE,
                                       len(gen)))
                hist = [*prompt, *gen]
    return RunResult("calibrate", recs)
