"""``kvtier ab``, ``kvtier calibrate`` and ``kvtier demo``.

    kvtier ab [--strategies recompute,device-ttl,host-p2p,tiered] [--trace FILE|--synthetic]
              [--out DIR] [--model tiny|bench|PATH] [--time-scale X] [--simulate]
    kvtier calibrate [--model tiny] [--stack ROUTER_URL] [--simulate] [--out FILE]
    kvtier demo

A live ``ab`` starts each strategy's stack in turn, replays the trace, then fits
a cost model to the run's own turns (in-sample), replays the same trace through
the simulator with it and reports the simulator's error next to the
measurements. ``--simulate`` runs only the simulator (cost model from
``--cost FILE`` or ``kvtier calibrate``'s defaults).

Threading model: each command runs on the caller's thread (the runner owns its
helper threads).
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
import time
from pathlib import Path

from kvtier.ab.fit import fit_from_records
from kvtier.ab.live.sweep import run_sweep
from kvtier.ab.records import RunResult, merge_repeats
from kvtier.ab.report import environment_meta, summary_table, write_report
from kvtier.ab.strategies import STRATEGY_NAMES, StrategySpec, parse_list
from kvtier.ab.traces import LengthDist, SyntheticTraceConfig, Trace, WaitDist, synthetic
from kvtier.cost.model import CostModel, LinkModel, kv_bytes_per_token
from kvtier.devstack.platform import kv_dtype_bytes

log = logging.getLogger("kvtier.ab")

DEMO_STRATEGIES = "recompute,device-ttl"
# `kvtier calibrate` measures prefill (recompute), D->P reads (device-ttl) and peer reads
# (host-p2p) on the same sweep.
CALIBRATE_WITH = "recompute,device-ttl,host-p2p"


# ----------------------------------------------------------------- shared pieces -----
def resolve_model(name: str) -> Path:
    if name in ("tiny", "bench"):
        from kvtier.devstack.models import build_model

        return Path(build_model(name))
    p = Path(name)
    if not (p / "config.json").exists():
        raise SystemExit(f"--model {name!r}: not a preset (tiny, bench) nor a model directory")
    return p


def model_facts(model_dir: Path) -> tuple[int, int]:
    """(KV bytes per token at the stack's serving dtype, max context) from config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return (kv_bytes_per_token(cfg, kv_dtype_bytes()),
            int(cfg.get("max_position_embeddings", 4096)))


def default_trace(max_context: int, conversations: int, turns: int, seed: int = 0) -> Trace:
    """An agentic trace whose context grows towards the model's limit."""
    first = max(64, max_context // 8)
    tool = max(32, (max_context - first) // max(1, turns) - 64)
    return synthetic(SyntheticTraceConfig(
        name=f"synthetic-{conversations}x{turns}-ctx{max_context}", conversations=conversations,
        turns=turns, first_prompt_tokens=LengthDist(mean=first, spread=0.2),
        response_tokens=LengthDist(mean=32, spread=0.5),
        tool_output_tokens=LengthDist(mean=tool, spread=0.3),
        wait=WaitDist(kind="lognormal", median_s=5.0, sigma=1.0, max_s=120.0),
        concurrency=min(conversations, 2), wave_interval_s=20.0, seed=seed,
        max_context_tokens=max_context - 8))


def trace_max_context(trace: Trace) -> int:
    """The longest prompt + response any turn of ``trace`` needs."""
    from kvtier.ab.traces import turn_plan

    return max((p.context_after for c in trace.conversations for p in turn_plan(c)), default=0)


def prior_cost_model(kvbpt: int, block_size: int = 32) -> CostModel:
    """Cost model used when nothing was measured (``--simulate`` without ``--cost``):
    tiny-model-on-this-CPU magnitudes; say so in the report."""
    link = LinkModel(setup_s=0.002, bytes_per_s=4e9)
    return CostModel(kv_bytes_per_token=kvbpt, prefill_a_s=0.01, prefill_b_s_per_token=2e-4,
                     prefill_c_s_per_token_ctx=2e-8, decode_s_per_token=0.004,
                     reads={"dp_read": link, "p2p": link}, block_size=block_size)


def _simulate(trace: Trace, specs: list[StrategySpec], cost: CostModel, prefill: int,
              decode: int, block_size: int, online_ttl: bool = True) -> list[RunResult]:
    from kvtier.ab.simulator import FleetSpec, simulate

    fleet = FleetSpec(prefill=prefill, decode=decode, block_size=block_size)
    return [simulate(trace, s.scaled(1.0), fleet, cost, online_ttl=online_ttl) for s in specs]


# ----------------------------------------------------------------- kvtier ab ---------
def _quiet() -> None:
    # one line per HTTP call / served request would bury the progress bar
    for name in ("httpx", "kvtier.router"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _flags(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    for k, v in sorted(vars(args).items()):
        if k in ("func", "command") or v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        out += [flag] if v is True else [flag, str(v)]
    return out


def run_ab(args: argparse.Namespace) -> int:
    _quiet()
    model_dir = resolve_model(args.model)
    kvbpt, max_ctx = model_facts(model_dir)
    max_ctx = min(max_ctx, args.max_model_len)
    if args.trace:
        trace = Trace.load(args.trace)
    else:
        trace = default_trace(max_ctx, args.conversations, args.turns, args.seed)
    need = trace_max_context(trace)
    if need > max_ctx:
        raise SystemExit(f"trace {trace.name!r} reaches {need} tokens of context; the stack serves "
                         f"at most {max_ctx} (--max-model-len {args.max_model_len}, model limit "
                         f"{model_facts(model_dir)[1]}): raise --max-model-len or use a shorter trace")
    host_bytes = _mib(args.host_mib)
    specs = [s.topology(args.prefill, args.decode).with_host_bytes(host_bytes)
             for s in parse_list(args.strategies, args.decode_ttl)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace.save(out / "trace.jsonl")
    cost = CostModel.model_validate_json(Path(args.cost).read_text()) if args.cost else None
    meta = {"model": f"{args.model} ({model_dir})", "trace": trace.name,
            "conversations": len(trace.conversations),
            "turns": sum(len(c.turns) for c in trace.conversations),
            "time_scale": args.time_scale,
            # how to run it again (every flag, defaults included)
            "command": "kvtier ab " + shlex.join(_flags(args)),
            "topology": f"{args.prefill}P{args.decode}D local vLLM stack, block size "
                        f"{args.block_size}, KV {kvbpt} B/token"}
    if args.simulate:
        cost = cost or prior_cost_model(kvbpt, args.block_size)
        specs = [s.with_cost_model(cost) for s in specs]
        results = _simulate(trace, specs, cost, args.prefill, args.decode, args.block_size)
        meta.update(mode="simulated", cost_model=cost.model_dump(),
                    cost_model_source=args.cost or "built-in prior (not measured)")
        md = write_report(results, out, meta)
        print(summary_table(results))
        print(f"\nreport: {md}")
        return 0

    from kvtier.ab.live.runner import MEASUREMENT, RunOptions, run_strategy

    opts = RunOptions(model=str(model_dir), time_scale=args.time_scale,
                      block_size=args.block_size, max_model_len=max_ctx,
                      kv_bytes_per_token=kvbpt,
                      log_dir=out / "logs", progress=not args.no_progress)
    meta["environment"] = environment_meta()  # the commit measured, not the one at report time
    t0 = time.time()
    sw = run_sweep(specs, trace, lambda s, tr: run_strategy(s, tr, opts), cost=cost,
                   kvbpt=kvbpt, block_size=args.block_size, time_scale=args.time_scale,
                   log_dir=opts.log_dir, repeats=args.repeats)
    meta.update(mode="live", measurement=MEASUREMENT, wall_s=round(time.time() - t0, 1))
    if sw.adaptive:
        meta["adaptive"] = sw.adaptive
    if sw.failed:
        meta["failed_strategies"] = sw.failed
    if not sw.results:
        log.error("no strategy finished; no report written (logs: %s)", opts.log_dir)
        return 130 if sw.interrupted else 1
    md = finish_report(sw.results, [s.scaled(args.time_scale) for s in sw.ran],
                       _scaled_trace(trace, args.time_scale), meta, out, kvbpt,
                       args.prefill, args.decode, args.block_size)
    print(summary_table(sw.results))
    if sw.failed:
        print("\nnot in the report (failed): "
              + ", ".join(f"{k} ({v})" for k, v in sw.failed.items()))
    print(f"\nreport: {md}")
    if sw.interrupted:
        return 130
    return 0 if not sw.failed and all(r.ok_turns for r in sw.results) else 1


def finish_report(results: list[RunResult], specs_as_run: list[StrategySpec], wall_trace: Trace,
                  meta: dict, out: Path, kvbpt: int, prefill: int, decode: int,
                  block_size: int) -> Path:
    """Fit the cost model to the measured turns, replay the trace through the simulator with
    it (device TTLs fixed, as live), and write the report. ``specs_as_run`` and ``wall_trace``
    are in wall-clock seconds (already scaled by the run's time scale)."""
    meta = {**meta, "kv_bytes_per_token": kvbpt, "block_size": block_size,
            "prefill": prefill, "decode": decode}
    simulated = None
    try:
        fitted = fit_from_records(results, kvbpt, block_size)
        simulated = _simulate(wall_trace, specs_as_run, fitted, prefill, decode, block_size,
                              online_ttl=False)  # live vLLM fixes the TTL at start
        # Repeated live runs: compare every repeat with the (deterministic) simulation.
        reps = {r.strategy: int(r.meta.get("repeats", 1)) for r in results}
        simulated = [merge_repeats([s] * reps.get(s.strategy, 1)) for s in simulated]
        meta.update(cost_model=fitted.model_dump(),
                    cost_model_source="fitted to this run's turns (in-sample)",
                    recommendation=fitted.recommend().model_dump())
    except Exception as e:  # noqa: BLE001 - the measured report stands without the simulator
        log.warning("simulator comparison skipped: %s", e)
        meta["simulator_skipped"] = str(e)
    return write_report(results, out, meta, simulated=simulated)


def run_ab_report(args: argparse.Namespace) -> int:
    """Re-render a live run's report from its report.json with this checkout's code."""
    import re

    import msgspec

    src = Path(args.dir)
    try:
        doc = json.loads((src / "report.json").read_text())
        trace = Trace.load(src / "trace.jsonl")
    except (OSError, ValueError) as e:
        raise SystemExit(f"{src}: not a kvtier ab output directory ({e})") from None
    meta = doc["meta"]
    if meta.get("mode") != "live":
        raise SystemExit(f"{src}: only live runs can be re-rendered (mode {meta.get('mode')!r})")
    results = msgspec.convert(doc["results"], list[RunResult])
    kvbpt = meta.get("kv_bytes_per_token")
    if kvbpt is None:
        m = re.search(r"KV (\d+) B/token", meta.get("topology", ""))
        if not m:
            raise SystemExit(f"{src}: report.json does not say the KV bytes per token")
        kvbpt = int(m.group(1))
    if "prefill" in meta and "decode" in meta:
        prefill, decode = int(meta["prefill"]), int(meta["decode"])
    else:  # reports written before finish_report stored the counts
        m = re.match(r"(\d+)P(\d+)D", meta.get("topology", "1P1D"))
        prefill, decode = (int(m.group(1)), int(m.group(2))) if m else (1, 1)
    specs = [StrategySpec.model_validate(r.meta["strategy_spec"]) for r in results]
    keep = {k: v for k, v in meta.items() if k not in (
        "environment", "cost_model", "cost_model_source", "recommendation", "simulator_skipped")}
    keep["rendered_from"] = f"{src} (measured at commit "\
                            f"{meta.get('environment', {}).get('git_commit', '?')})"
    keep["environment"] = meta.get("environment", {})
    out = Path(args.out or src)
    md = finish_report(results, specs, _scaled_trace(trace, float(meta.get("time_scale", 1.0))),
                       keep, out, int(kvbpt), prefill, decode,
                       int(meta.get("block_size", 32)))
    print(summary_table(results))
    print(f"\nreport: {md}")
    return 0


def _mib(mib: float | None) -> int | None:
    return None if mib is None else int(mib * (1 << 20))


def _scaled_trace(trace: Trace, k: float) -> Trace:
    if k == 1.0:
        return trace
    from kvtier.ab.traces import ConversationSpec, TurnSpec

    convs = [ConversationSpec(c.conversation_id, c.start_s * k, c.seed,
                              [TurnSpec(t.new_tokens, t.response_tokens, t.wait_s * k,
                                        t.strip_reasoning) for t in c.turns])
             for c in trace.conversations]
    return Trace(trace.name, trace.vocab_size, convs)


# ----------------------------------------------------------------- kvtier calibrate --
def calibration_trace(max_context: int, gap_s: float = 0.0) -> Trace:
    """Fresh prompts of growing size, each followed by turns that add growing deltas;
    conversation k starts at ``k * gap_s`` (the simulated calibration spaces them so no two
    prefills overlap; the live one runs them one after another)."""
    from kvtier.ab.traces import ConversationSpec, TurnSpec

    convs = []
    sizes = [n for n in (64, 256, 512, 1024, 2048, 4096) if n * 2 < max_context]
    for k, n in enumerate(sizes):
        turns = [TurnSpec(n, 8, 0.0)]
        for d in (32, 128, 512):
            if n * 2 + d + 64 < max_context:
                turns.append(TurnSpec(d, 8, 0.0))
        convs.append(ConversationSpec(f"cal{k}", k * gap_s, 1000 + k, turns))
    return Trace("calibration", 4096, convs)


def run_calibrate(args: argparse.Namespace) -> int:
    _quiet()
    model_dir = resolve_model(args.model)
    kvbpt, max_ctx = model_facts(model_dir)
    max_ctx = min(max_ctx, args.max_model_len)
    trace = calibration_trace(max_ctx)
    if args.simulate:
        truth = prior_cost_model(kvbpt, args.block_size)
        results = _simulate(calibration_trace(max_ctx, gap_s=1e4), parse_list(CALIBRATE_WITH),
                            truth, 1, 1, args.block_size)
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

    from kvtier.ab.records import TurnRecord
    from kvtier.ab.traces import token_ids

    recs = []
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
                                       "local" if cached else "none", len(prompt) - cached, dt,
                                       dt, 0.0, 0.0, "", len(gen)))
                hist = [*prompt, *gen]
    return RunResult("calibrate", recs)


# ----------------------------------------------------------------- kvtier demo -------
def run_demo(args: argparse.Namespace) -> int:
    ns = argparse.Namespace(
        model="tiny", strategies=args.strategies, trace=None, out=args.out,
        time_scale=args.time_scale, simulate=False, conversations=3, turns=4, seed=0,
        decode_ttl=None, host_mib=None, prefill=1, decode=1, block_size=32, max_model_len=2048, cost=None,
        no_progress=False, repeats=1)
    return run_ab(ns)


# ----------------------------------------------------------------- registration ------
def _positive_int(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="tiny | bench | model directory")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="context cap for generated traces (the stack's max_model_len)")
    p.add_argument("--no-progress", action="store_true")


def register(subparsers) -> None:
    p = subparsers.add_parser("ab", help="A/B-compare retention strategies on one trace",
                              description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--strategies", default="recompute,device-ttl,host-p2p,tiered",
                   help=f"comma list of {', '.join(STRATEGY_NAMES)}")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--trace", help="trace file (JSONL, kvtier.ab.traces format)")
    g.add_argument("--synthetic", action="store_true", help="generate a trace (default)")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="ab-report")
    p.add_argument("--repeats", type=_positive_int, default=1,
                   help="run every strategy this many times, interleaved and rotated (A B C, B C A, ...); "
                        "medians pool all repeats, memory integrals are per run (live only)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply waits (and device TTLs) by this; <1 shortens a run")
    p.add_argument("--decode-ttl", type=float, default=None,
                   help="device TTL (s) for strategies that retain on decode")
    p.add_argument("--host-mib", type=float, default=None,
                   help="host tier size per instance in MiB (default: the config file's, 256)")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--cost", help="CostModel JSON (from kvtier calibrate --out)")
    p.add_argument("--simulate", action="store_true",
                   help="run the discrete-event simulator instead of the live stack")
    _common(p)
    p.set_defaults(func=run_ab)

    c = subparsers.add_parser("calibrate", help="fit the cost model; print thresholds")
    c.add_argument("--stack", help="router URL of a running stack (default: start a local one)")
    c.add_argument("--simulate", action="store_true", help="calibrate against the simulator")
    c.add_argument("--out", help="write the fitted CostModel JSON here")
    c.add_argument("--log-dir", default="ab-calibrate-logs")
    _common(c)
    c.set_defaults(func=run_calibrate)

    r = subparsers.add_parser("ab-report", help="re-render a live kvtier ab run's report "
                                                "(refit, re-simulate, targets) from its report.json")
    r.add_argument("dir", help="the run's --out directory (report.json, trace.jsonl)")
    r.add_argument("--out", default=None, help="where to write (default: the same directory)")
    r.set_defaults(func=run_ab_report)

    d = subparsers.add_parser("demo", help="a short A/B on the tiny model (what ./run demo runs)")
    d.add_argument("--strategies", default=DEMO_STRATEGIES)
    d.add_argument("--out", default="ab-demo")
    d.add_argument("--time-scale", type=float, default=0.1)
    d.set_defaults(func=run_demo)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - convenience
    ap = argparse.ArgumentParser(prog="kvtier")
    register(ap.add_subparsers(dest="command"))
    a = ap.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
