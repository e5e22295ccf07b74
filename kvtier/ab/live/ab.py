"""``kvtier ab`` and ``kvtier ab-report``: run (or simulate) every strategy on one trace and
write the report.

A live ``ab`` starts each strategy's stack in turn (``kvtier.ab.live.sweep``,
``kvtier.ab.live.runner``), replays the trace, then fits a cost model to the run's own turns
(in-sample), replays the same trace through the simulator with it and reports the
simulator's error next to the measurements. ``--simulate`` runs only the simulator (cost
model from ``--cost FILE`` or the built-in prior); with a TTFT p90 SLO (``--slo-ttft-p90``, else
the regime's ``slo_ttft_p90_s``) it then sizes the fleet: the concurrent sessions each
strategy holds at the SLO (``kvtier.ab.sizing``; ``sizing.md``, ``sizing.json``). ``ab-report``
re-renders a live run's report from its ``report.json.gz`` with this checkout's code.

``--stack STRATEGY=ROUTER_URL`` (repeated) runs on stacks already running instead of starting
local ones (``kvtier.ab.live.running``): the strategy names label them, their shape and block
size come from their routers and engines, the same sweep replays the trace through each
router in turn (``kvtier.ab.live.runner.run_on_stack``), and the report gets a section per
stack: what was checked against its strategy, what was not, and what it did not allow.

A trace file that carries a regime (``kvtier.ab.regimes``) brings its stack settings: time
scale, context cap, device TTL, host tier size, the decode nodes' KV capacity; a flag given on
the command line wins over the file. Every simulation (the ``--simulate`` report, the one next
to a live run's measurements, the sizing) gives its decode instances the regime's KV capacity
(``decode_num_blocks``; without one, `FleetSpec`'s default), so turns queue at a full decode
in the simulation as on the stack.

Threading model: each command runs on the caller's thread (the runner owns its helper
threads).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.ab.fit import fit_shared_host
from kvtier.ab.live.common import (
    model_facts,
    prior_cost_model,
    quiet_http_logs,
    resolve_model,
    sim_fleet,
)
from kvtier.ab.live.running import MEASUREMENT as RUNNING_MEASUREMENT
from kvtier.ab.live.running import (
    RunningStack,
    StackError,
    discover,
    parse_engine_metrics,
    parse_stacks,
    reset_prefix_caches,
    stacks_markdown,
    verify,
)
from kvtier.ab.live.sweep import run_sweep
from kvtier.ab.rawdoc import read_raw
from kvtier.ab.records import RunResult, merge_repeats
from kvtier.ab.regimes import RegimeSettings, read_regime, save_regime
from kvtier.ab.report import environment_meta, summary_table, write_report
from kvtier.ab.simulator import simulate_all
from kvtier.ab.strategies import StrategySpec, builtin, parse_list
from kvtier.ab.traces import LengthDist, SyntheticTraceConfig, Trace, WaitDist, synthetic
from kvtier.cost.model import CostModel
from kvtier.devstack.placement import SPINNER_NICE, spinner_priority

log = logging.getLogger("kvtier.ab")

DEFAULT_STRATEGIES = "recompute,device-ttl,host-p2p,tiered"
SINGLE_ENGINE_DEFAULT = "recompute,host-p2p"  # --single-engine on vLLM-CPU (+ vllm-offload: GPU)


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


def _flags(args: argparse.Namespace) -> list[str]:
    """The command line that repeats this run (every flag, defaults included)."""
    out: list[str] = []
    for k, v in sorted(vars(args).items()):
        if k in ("func", "command") or v is None or v is False:
            continue
        flag = "--" + k.replace("_", "-")
        if isinstance(v, list):  # a repeatable flag (--stack, --engine-metrics)
            for item in v:
                out += [flag, str(item)]
        else:
            out += [flag] if v is True else [flag, str(v)]
    return out


def run_ab(args: argparse.Namespace) -> int:
    """``kvtier ab``: the report of every strategy on one trace, live or simulated."""
    quiet_http_logs()
    if getattr(args, "slo_ttft_p90", None) is not None and not args.simulate:
        raise SystemExit("--slo-ttft-p90 sizes the fleet by simulation: add --simulate")
    stack_args = getattr(args, "stack", None) or []
    if getattr(args, "single_engine", False):  # one engine per strategy: no P/D shape
        if getattr(args, "strategies", None) is None:
            args.strategies = SINGLE_ENGINE_DEFAULT
    elif not stack_args:  # a local run: the defaults `kvtier ab --help` names
        for k, v in (("strategies", DEFAULT_STRATEGIES), ("prefill", 1), ("decode", 1)):
            if getattr(args, k, None) is None:
                setattr(args, k, v)
    model_dir = resolve_model(args.model)
    regime = (read_regime(args.trace) if args.trace else None) or RegimeSettings()
    # the command line wins over the regime file; `_flags` then repeats the values used
    if getattr(args, "time_scale", None) is None:
        args.time_scale = regime.time_scale or 1.0
    if getattr(args, "max_model_len", None) is None:
        args.max_model_len = regime.max_model_len or 4096
    if getattr(args, "decode_ttl", None) is None:
        args.decode_ttl = regime.decode_ttl_s
    kvbpt, max_ctx = model_facts(model_dir)
    max_ctx = min(max_ctx, args.max_model_len)
    running = _discover(args, model_dir) if stack_args else {}
    for st in running.values():
        max_ctx = min(max_ctx, st.max_model_len or max_ctx)
    if args.trace:
        trace = Trace.load(args.trace)
    else:
        trace = default_trace(max_ctx, args.conversations, args.turns, args.seed)
    need = trace_max_context(trace)
    if need > max_ctx:
        raise SystemExit(f"trace {trace.name!r} reaches {need} tokens of context; the stack serves "
                         f"at most {max_ctx} (--max-model-len {args.max_model_len}, model limit "
                         f"{model_facts(model_dir)[1]}"
                         + "".join(f", {s.strategy}'s engines {s.max_model_len}"
                                   for s in running.values() if s.max_model_len)
                         + "): raise --max-model-len or use a shorter trace")
    host_bytes = _mib(args.host_mib) if args.host_mib is not None else \
        regime.host_bytes(trace, kvbpt)
    if running:
        # the strategy names label the stacks; their shape is what the routers show
        specs = [builtin(name, args.decode_ttl).with_host_bytes(host_bytes) for name in running]
        shapes = {(st.count("prefill"), st.count("decode")) for st in running.values()}
        prefill, decode = min(shapes)
        block_size = _stack_block_size(running, args.block_size)
    elif getattr(args, "single_engine", False):
        try:
            specs = [s.single().with_host_bytes(host_bytes)
                     for s in parse_list(args.strategies, args.decode_ttl)]
        except ValueError as e:
            raise SystemExit(f"--single-engine: {e}") from None
        prefill, decode, block_size = 1, 0, args.block_size
    else:
        specs = [s.topology(args.prefill, args.decode).with_host_bytes(host_bytes)
                 for s in parse_list(args.strategies, args.decode_ttl)]
        prefill, decode, block_size = args.prefill, args.decode, args.block_size
    if getattr(args, "cost_refit", False):
        specs = [s.with_cost_refit() for s in specs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if regime != RegimeSettings():
        save_regime(trace, regime, out / "trace.jsonl")
    else:
        trace.save(out / "trace.jsonl")
    cost = CostModel.model_validate_json(Path(args.cost).read_text()) if args.cost else None
    if running:
        topology = "running stacks: " + "; ".join(f"{n} {st.topology} behind {st.url}"
                                                  for n, st in running.items())
    elif decode == 0:
        topology = "one local vLLM engine per strategy (no P/D split, no router)"
    else:
        topology = f"{args.prefill}P{args.decode}D local vLLM stack"
    meta: dict[str, Any] = {"model": f"{args.model} ({model_dir})", "trace": trace.name,
                            "conversations": len(trace.conversations),
                            "turns": sum(len(c.turns) for c in trace.conversations),
                            "time_scale": args.time_scale,
                            # how to run it again (every flag, defaults included)
                            "command": "kvtier ab " + shlex.join(_flags(args)),
                            "topology": f"{topology}, block size {block_size}, "
                                        f"KV {kvbpt} B/token"}
    if regime != RegimeSettings():
        meta["regime"] = {**regime.model_dump(exclude_defaults=True, mode="json"),
                          "host_bytes_per_instance": host_bytes}
    if args.simulate:
        cost = cost or prior_cost_model(kvbpt, args.block_size)
        specs = [s.with_cost_model(cost) for s in specs]
        results = simulate_all(trace, specs, sim_fleet(args.prefill, args.decode, args.block_size,
                                                       regime.decode_num_blocks), cost)
        meta.update(mode="simulated", cost_model=cost.model_dump(),
                    cost_model_source=args.cost or "built-in prior (not measured)")
        md = write_report(results, out, meta)
        print(summary_table(results))
        print(f"\nreport: {md}")
        slo = getattr(args, "slo_ttft_p90", None) or regime.slo_ttft_p90_s
        if slo:
            run_sizing(args, trace, specs, cost, regime, float(slo), out)
        return 0

    from kvtier.ab.live.runner import (
        MEASUREMENT,
        SINGLE_ENGINE_MEASUREMENT,
        RunOptions,
        run_strategy,
    )

    opts = RunOptions(model=str(model_dir), time_scale=args.time_scale,
                      block_size=block_size, max_model_len=max_ctx,
                      kv_bytes_per_token=kvbpt,
                      log_dir=out / "logs", progress=not args.no_progress,
                      extra_args=regime.extra_args, role_args=regime.role_args(),
                      role_env=regime.role_env(), spinner_nice=_spinner(args))
    meta["environment"] = environment_meta()  # the commit measured, not the one at report time
    t0 = time.time()
    run_notes: dict[str, dict[str, None]] = {}  # running stacks: what each run could not do
    if running:
        run_one = _on_running(running, opts, run_notes)
    else:
        def run_one(s: StrategySpec, tr: Trace) -> RunResult:
            return run_strategy(s, tr, opts)
    sw = run_sweep(specs, trace, run_one, cost=cost, kvbpt=kvbpt, block_size=block_size,
                   time_scale=args.time_scale, log_dir=opts.log_dir, repeats=args.repeats)
    meta.update(mode="live", measurement=MEASUREMENT, wall_s=round(time.time() - t0, 1))
    if decode == 0:
        meta["measurement"] = {**MEASUREMENT, **SINGLE_ENGINE_MEASUREMENT}
    if running:
        meta["measurement"] = {**MEASUREMENT, **RUNNING_MEASUREMENT}
        meta["stacks"] = {n: {**st.describe(), "verified": verify(spec, st),
                              "run_notes": list(run_notes.get(n, {}))}
                          for (n, st), spec in zip(running.items(), specs, strict=True)}
        if len(shapes) > 1:
            meta["stack_shapes_differ"] = sorted(f"{p}P{d}D" for p, d in shapes)
    elif sw.adaptive:  # a running stack's router was configured by whoever deployed it
        meta["adaptive"] = sw.adaptive
    if sw.interrupted and sw.repeats_done:
        meta["repeats_completed"] = f"{sw.repeats_done} of {args.repeats} (interrupted)"
    if sw.failed:
        meta["failed_strategies"] = sw.failed
    if not sw.results:
        log.error("no strategy finished; no report written (logs: %s)", opts.log_dir)
        return 130 if sw.interrupted else 1
    md = finish_report(sw.results, [s.scaled(args.time_scale) for s in sw.ran],
                       _scaled_trace(trace, args.time_scale), meta, out, kvbpt,
                       prefill, decode, block_size,
                       None if running else regime.decode_num_blocks)
    print(summary_table(sw.results))
    if sw.failed:
        print("\nnot in the report (failed): "
              + ", ".join(f"{k} ({v})" for k, v in sw.failed.items()))
    print(f"\nreport: {md}")
    if sw.interrupted:
        return 130
    return 0 if not sw.failed and all(r.ok_turns for r in sw.results) else 1


def _discover(args: argparse.Namespace, model_dir: Path) -> dict[str, RunningStack]:
    """Every ``--stack``, found from its router (``--engine-metrics``: its pages as given)."""
    import httpx

    try:
        urls = parse_stacks(args.stack)
        given = parse_engine_metrics(getattr(args, "engine_metrics", None) or [], list(urls))
        with httpx.Client(timeout=10) as http:
            found = {n: discover(http, n, u, given.get(n, ()), model_dir.name)
                     for n, u in urls.items()}
    except StackError as e:
        raise SystemExit(str(e)) from None
    for n, st in found.items():
        log.info("%s: router %s, %s, model %s, metrics %s", n, st.url, st.topology,
                 st.model_name, st.source)
        for note in st.notes:
            log.warning("%s: %s", n, note)
    return found


def _stack_block_size(running: dict[str, RunningStack], flag: int) -> int:
    """The stacks' block size when their engines all say the same one, else ``--block-size``."""
    sizes = {st.block_size for st in running.values() if st.block_size}
    if len(sizes) == 1 and (size := sizes.pop()) != flag:
        log.warning("the stacks' engines use block size %d, not --block-size %d: using %d",
                    size, flag, size)
        return size
    if len(sizes) > 1:
        log.warning("the stacks' engines use block sizes %s: using --block-size %d",
                    sorted(sizes), flag)
    return flag


def _on_running(running: dict[str, RunningStack], opts: Any,
                notes: dict[str, dict[str, None]]) -> Callable[[StrategySpec, Trace], RunResult]:
    """The sweep's ``run_one`` on running stacks: reset the engines' prefix caches where they
    allow it (what they do not allow goes to ``notes``), then replay."""
    import httpx

    from kvtier.ab.live.runner import run_on_stack

    def run_one(s: StrategySpec, tr: Trace) -> RunResult:
        st = running[s.name]
        with httpx.Client(timeout=10) as http:
            for n in reset_prefix_caches(http, st):
                log.warning("%s: %s", s.name, n)
                notes.setdefault(s.name, {})[n] = None
        return run_on_stack(s, st, tr, opts)
    return run_one


def run_sizing(args: argparse.Namespace, trace: Trace, specs: list[StrategySpec], cost: CostModel,
               regime: RegimeSettings, slo: float, out: Path) -> None:
    """The sessions each strategy holds at TTFT p90 ≤ ``slo`` on the ``--prefill``/``--decode``
    fleet (decode KV capacity: the regime's, if any): printed, and written to ``out``."""
    import msgspec
    from tqdm import tqdm

    from kvtier.ab.sizing import DEFAULT_MAX_SESSIONS, size_for_slo

    fleet = sim_fleet(args.prefill, args.decode, args.block_size, regime.decode_num_blocks)
    with tqdm(desc=f"sizing at TTFT p90 <= {slo:g} s", unit="sim",
              disable=bool(getattr(args, "no_progress", False))) as bar:
        def tick(strategy: str, sessions: int, p90: float) -> None:
            bar.set_postfix_str(f"{strategy}: {sessions} sessions, p90 {p90:.2f} s",
                                refresh=False)
            bar.update()

        answer = size_for_slo(trace, specs, fleet, cost, slo,
                              max_sessions=getattr(args, "max_sessions", None)
                              or DEFAULT_MAX_SESSIONS, progress=tick)
    (out / "sizing.json").write_bytes(msgspec.json.format(msgspec.json.encode(answer)) + b"\n")
    (out / "sizing.md").write_text(answer.report())
    print(f"\nSessions held at TTFT p90 <= {slo:g} s (simulated):\n")
    print(answer.markdown())
    print(f"\nsizing: {out / 'sizing.md'}")


def finish_report(results: list[RunResult], specs_as_run: list[StrategySpec], wall_trace: Trace,
                  meta: dict[str, Any], out: Path, kvbpt: int, prefill: int, decode: int,
                  block_size: int, decode_blocks: int | None = None) -> Path:
    """Fit the cost model to the measured turns, replay the trace through the simulator with
    it (device TTLs fixed, as live; decode capacity ``decode_blocks``, the regime's, if set),
    and write the report. Every engine of the local stack shares this host, so the fit also
    finds how much a busy decode slows a prefill (`kvtier.ab.fit.fit_shared_host`) and the
    simulator applies it. ``specs_as_run`` and ``wall_trace`` are in wall-clock seconds
    (already scaled by the run's time scale). Running stacks (``meta["stacks"]``) get their
    own section, before the summary; stacks of different shapes are not simulated (one fleet
    replays every strategy)."""
    meta = {**meta, "kv_bytes_per_token": kvbpt, "block_size": block_size,
            "prefill": prefill, "decode": decode}
    simulated = None
    try:
        if decode == 0:
            raise ValueError("one engine per strategy: the simulator models a P/D fleet")
        if meta.get("stack_shapes_differ"):
            raise ValueError(f"the running stacks differ in shape "
                             f"({', '.join(meta['stack_shapes_differ'])}): one simulated fleet "
                             f"cannot stand for all of them")
        offload = {s.name for s in specs_as_run if s.vllm_offload}
        shared = fit_shared_host([r for r in results if r.strategy not in offload], kvbpt,
                                 block_size, decode_instances=decode)
        fitted = shared.cost
        # live vLLM fixes the TTL at start; with decode leases the router re-chooses online
        fleet = sim_fleet(prefill, decode, block_size, decode_blocks,
                          decode_interference=shared.decode_interference)
        # vLLM's own CPU offloading (vllm-offload) is not modelled by the simulator
        sim_specs = [s for s in specs_as_run if s.name not in offload]
        if offload:
            meta["not_simulated"] = sorted(offload)
        simulated = simulate_all(wall_trace, sim_specs, fleet, fitted, online_ttl=None)
        # Repeated live runs: compare every repeat with the (deterministic) simulation.
        reps = {r.strategy: int(r.meta.get("repeats", 1)) for r in results}
        simulated = [merge_repeats([s] * reps.get(s.strategy, 1)) for s in simulated]
        meta.update(cost_model=fitted.model_dump(),
                    cost_model_source="fitted to this run's turns (in-sample)",
                    decode_interference=shared.decode_interference,
                    recommendation=fitted.recommend().model_dump())
    except Exception as e:  # noqa: BLE001 - the measured report stands without the simulator
        log.warning("simulator comparison skipped: %s", e)
        meta["simulator_skipped"] = str(e)
    md = write_report(results, out, meta, simulated=simulated)
    section = stacks_markdown(meta)
    if section:
        text = md.read_text()
        at = text.find("\n## Summary")
        at = len(text) if at < 0 else at + 1
        md.write_text(text[:at] + "\n".join(section) + "\n" + text[at:])
    return md


def run_ab_report(args: argparse.Namespace) -> int:
    """Re-render a live run's report from its report.json.gz with this checkout's code."""
    import re

    import msgspec

    src = Path(args.dir)
    try:
        doc = read_raw(src)
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
            raise SystemExit(f"{src}: its report does not say the KV bytes per token")
        kvbpt = int(m.group(1))
    if "prefill" in meta and "decode" in meta:
        prefill, decode = int(meta["prefill"]), int(meta["decode"])
    else:  # reports written before finish_report stored the counts
        m = re.match(r"(\d+)P(\d+)D", meta.get("topology", "1P1D"))
        prefill, decode = (int(m.group(1)), int(m.group(2))) if m else (1, 1)
    specs = [StrategySpec.model_validate(r.meta["strategy_spec"]) for r in results]
    keep = {k: v for k, v in meta.items() if k not in (
        "environment", "cost_model", "cost_model_source", "recommendation", "simulator_skipped",
        "decode_interference")}
    keep["rendered_from"] = f"{src} (measured at commit "\
                            f"{meta.get('environment', {}).get('git_commit', '?')})"
    keep["environment"] = meta.get("environment", {})
    out = Path(args.out or src)
    md = finish_report(results, specs, _scaled_trace(trace, float(meta.get("time_scale", 1.0))),
                       keep, out, int(kvbpt), prefill, decode,
                       int(meta.get("block_size", 32)),
                       (meta.get("regime") or {}).get("decode_num_blocks"))
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


def _spinner(args: argparse.Namespace) -> int | None:
    """``RunOptions.spinner_nice`` from ``--spinner-nice``: the placement default when absent,
    None (SCHED_IDLE) for ``idle``."""
    v = getattr(args, "spinner_nice", None)
    return SPINNER_NICE if v is None else spinner_priority(v)
