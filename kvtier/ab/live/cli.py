"""``kvtier ab``, ``kvtier calibrate`` and ``kvtier demo``.

    kvtier ab [--strategies recompute,device-ttl,host-p2p,tiered] [--trace FILE|--synthetic]
              [--out DIR] [--model tiny|bench|PATH] [--time-scale X]
              [--simulate [--slo-ttft-p90 SECONDS [--max-sessions N]]]
    kvtier ab --single-engine [--strategies recompute,host-p2p] [--trace FILE|--synthetic] ...
    kvtier ab --stack STRATEGY=ROUTER_URL [--stack ...] [--engine-metrics STRATEGY=[ROLE=]URL,...]
              [--trace FILE|--synthetic] [--out DIR] [--model tiny|bench|PATH] [--time-scale X]
    kvtier calibrate [--model tiny] [--stack ROUTER_URL] [--simulate] [--out FILE]
    kvtier demo [--model bench] [--strategies recompute,device-ttl,host-p2p]
    kvtier ab-report DIR [--out DIR] | --all ROOT

A live ``ab`` starts each strategy's stack in turn, replays the trace, then fits
a cost model to the run's own turns (in-sample), replays the same trace through
the simulator with it and reports the simulator's error next to the
measurements. ``--simulate`` runs only the simulator (cost model from
``--cost FILE`` or ``kvtier calibrate``'s defaults); with ``--slo-ttft-p90`` (or a
regime trace's SLO) it then sizes the fleet: the most concurrent sessions of the
trace (copies of its conversations) each strategy holds with a simulated TTFT
p90 within the SLO (sizing.md, sizing.json).

With ``--single-engine`` each strategy runs on one engine that serves whole turns: no P/D
split, no router, no indexer, so no KV crosses a link between processes (recompute,
host-p2p: kvtier's host tier, vllm-offload on a GPU; strategies that retain on a decode
node are refused). The client talks to the engine; TTFT is the first streamed token.

With ``--stack`` it starts nothing: each STRATEGY=ROUTER_URL is a stack already
running (started by ``kvtier stack up`` and ``kvtier router``, or deployed),
labelled with that strategy. The same trace is replayed through each router in
turn; the engines' metrics pages are found from the router's /healthz, or given
(``--engine-metrics``). The report says what was checked against each strategy
and what a running stack did not allow.

Threading model: each command runs on the caller's thread (the runner owns its
helper threads).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from kvtier.ab.live.ab import DEFAULT_STRATEGIES, run_ab, run_ab_report
from kvtier.ab.live.calibrate import run_calibrate
from kvtier.ab.live.demo import DEMO_MODEL, DEMO_STRATEGIES, run_demo
from kvtier.ab.strategies import GPU_STRATEGY_NAMES, STRATEGY_NAMES
from kvtier.devstack.placement import SPINNER_CHOICES

# This module only declares the commands' arguments (its docstring is `kvtier ab --help`'s
# text); each command lives in its own module: `kvtier ab` and `kvtier ab-report` in
# kvtier.ab.live.ab, `kvtier calibrate` in kvtier.ab.live.calibrate, `kvtier demo` in
# kvtier.ab.live.demo.

# ----------------------------------------------------------------- registration ------
def _positive_int(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _positive_float(v: str) -> float:
    x = float(v)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {v}")
    return x


def _ab(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """``kvtier ab``, with the checks that span flags (an argparse error, like the others)."""
    def run(args: argparse.Namespace) -> int:
        if args.slo_ttft_p90 is not None and not args.simulate:
            p.error("--slo-ttft-p90 sizes the fleet by simulation: it needs --simulate")
        if args.engine_metrics and not args.stack:
            p.error("--engine-metrics names the metrics pages of a --stack")
        if args.single_engine:
            clash = [f for f, v in (("--stack", args.stack), ("--simulate", args.simulate),
                                    ("--prefill", args.prefill), ("--decode", args.decode),
                                    ("--decode-ttl", args.decode_ttl),
                                    ("--cost-refit", args.cost_refit),
                                    ("--spinner-nice", args.spinner_nice))
                     if v not in (None, False)]
            if clash:
                p.error(f"--single-engine runs one local engine per strategy (no P/D, no "
                        f"router): not with {', '.join(clash)}")
        if args.stack:
            # what a running stack already is: its strategies, shape and settings
            local = [f for f, v in (("--strategies", args.strategies), ("--prefill", args.prefill),
                                    ("--decode", args.decode), ("--decode-ttl", args.decode_ttl),
                                    ("--host-mib", args.host_mib), ("--simulate", args.simulate),
                                    ("--cost-refit", args.cost_refit),
                                    ("--spinner-nice", args.spinner_nice))
                     if v not in (None, False)]
            if local:
                p.error(f"{', '.join(local)}: set by the running stacks, not with --stack "
                        f"(the strategy names come from --stack STRATEGY=ROUTER_URL)")
        return run_ab(args)
    return run


def _ab_report(args: argparse.Namespace) -> int:
    """``kvtier ab-report DIR`` (refit, re-simulate) or ``--all ROOT`` (re-render everything)."""
    if args.all_root:
        from pathlib import Path

        from kvtier.ab.live.regen import write_all

        for f in write_all(Path(args.all_root)):
            print(f"regenerated {f}")
        return 0
    return run_ab_report(args)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="tiny | bench | model directory")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=4096,
                   help="context cap for generated traces (the stack's max_model_len)")
    p.add_argument("--no-progress", action="store_true")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("ab", help="A/B-compare retention strategies on one trace",
                              description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--strategies", default=None,
                   help=f"comma list of {', '.join(STRATEGY_NAMES)} "
                        f"(default {DEFAULT_STRATEGIES}); on a GPU also "
                        f"{', '.join(GPU_STRATEGY_NAMES)}")
    p.add_argument("--stack", action="append", default=None, metavar="STRATEGY=ROUTER_URL",
                   help="a stack already running, labelled STRATEGY, reached through its "
                        "router (repeat for each; instead of starting local stacks)")
    p.add_argument("--engine-metrics", action="append", default=None,
                   metavar="STRATEGY=[ROLE=]URL,...",
                   help="with --stack: that stack's metrics pages (vLLM engines, ROLE prefill|"
                        "decode|both; decode lease metrics; host tiers) instead of those found "
                        "from its router's /healthz")
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
    p.add_argument("--time-scale", type=float, default=None,
                   help="multiply waits (and device TTLs) by this; <1 shortens a run "
                        "(default: the regime file's, else 1)")
    p.add_argument("--decode-ttl", type=float, default=None,
                   help="device TTL (s) for strategies that retain on decode")
    p.add_argument("--host-mib", type=float, default=None,
                   help="host tier size per instance in MiB (default: the regime file's, else "
                        "the config file's, 256)")
    p.add_argument("--single-engine", action="store_true",
                   help="one engine per strategy, serving whole turns: no P/D split, no router, "
                        "no indexer (recompute, host-p2p; vllm-offload on a GPU)")
    p.add_argument("--spinner-nice", choices=SPINNER_CHOICES, default=None, metavar="0..19|idle",
                   help="priority the local stack gives NIXL's spinning progress threads: nice "
                        "N (0-19) or idle (SCHED_IDLE); default kvtier.devstack.placement's "
                        "(nice 10). A diagnostic: what the spinners cost the engines beside them")
    p.add_argument("--prefill", type=int, default=None, help="prefill instances (default 1)")
    p.add_argument("--decode", type=int, default=None, help="decode instances (default 1)")
    p.add_argument("--cost", help="CostModel JSON (from kvtier calibrate --out)")
    p.add_argument("--cost-refit", action="store_true",
                   help="adaptive strategies with decode leases (tiered-adaptive): the router "
                        "refits --cost online from the prefill legs it times (cost_refit)")
    p.add_argument("--simulate", action="store_true",
                   help="run the discrete-event simulator instead of the live stack")
    p.add_argument("--slo-ttft-p90", type=_positive_float, default=None, metavar="SECONDS",
                   help="with --simulate: also size the fleet -- the concurrent sessions each "
                        "strategy holds at this TTFT p90 (default: the regime file's SLO, if any)")
    p.add_argument("--max-sessions", type=_positive_int, default=None,
                   help="the sizing searches up to this many sessions (default 512)")
    _common(p)
    # None: the regime file's max_model_len, else 4096 (kvtier.ab.live.ab.run_ab)
    p.set_defaults(func=_ab(p), max_model_len=None)

    c = subparsers.add_parser("calibrate", help="fit the cost model; print thresholds")
    c.add_argument("--stack", help="router URL of a running stack (default: start a local one)")
    c.add_argument("--simulate", action="store_true", help="calibrate against the simulator")
    c.add_argument("--out", help="write the fitted CostModel JSON here")
    c.add_argument("--log-dir", default="ab-calibrate-logs")
    _common(c)
    c.set_defaults(func=run_calibrate)

    r = subparsers.add_parser("ab-report", help="re-render a live kvtier ab run's report "
                                                "(refit, re-simulate, targets) from its report.json.gz")
    rg = r.add_mutually_exclusive_group(required=True)
    rg.add_argument("dir", nargs="?", help="the run's --out directory (report.json.gz, trace.jsonl)")
    rg.add_argument("--all", metavar="ROOT", dest="all_root",
                    help="regenerate every committed report under ROOT/ab/*/ (report.md, "
                         "regime-table.md, report.json.gz's derived keys) and the generated blocks "
                         "of ROOT/AB.md and ROOT/../README.md from their raw JSON, no refit "
                         "(e.g. --all benchmarks)")
    r.add_argument("--out", default=None, help="where to write (default: the same directory)")
    r.set_defaults(func=_ab_report)

    d = subparsers.add_parser("demo", help="a short A/B where reuse pays (what ./run demo runs)")
    d.add_argument("--strategies", default=DEMO_STRATEGIES)
    d.add_argument("--model", default=DEMO_MODEL, help="tiny | bench | model directory")
    d.add_argument("--out", default="ab-demo")
    d.add_argument("--time-scale", type=float, default=1.0)
    d.set_defaults(func=run_demo)


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - convenience
    ap = argparse.ArgumentParser(prog="kvtier")
    register(ap.add_subparsers(dest="command"))
    a = ap.parse_args(argv)
    return int(a.func(a))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
