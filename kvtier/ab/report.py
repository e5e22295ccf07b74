"""The A/B report: JSON, a Markdown table and PNG plots from ``RunResult``s.

``write_report(results, out_dir, meta, simulated=...)`` writes

- ``report.json.gz`` (``kvtier.ab.rawdoc``): every record, each strategy's summary, the run's metadata
  and (when given) the simulator's predictions and their error;
- ``report.md``: machine, model, trace, commit, how things were measured, the
  summary table, TTFT per context bucket, the simulator's error;
- ``ttft_vs_context.png``, ``prefill_split.png``, ``memory_over_time.png``,
  ``reuse_by_path.png``.

Every number comes from the records handed in; nothing here is a constant of
a particular run. ``environment_meta()`` collects the machine and commit.

Threading model: pure functions (matplotlib with the non-interactive Agg
backend); call from one thread at a time.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from kvtier.ab.compare import (
    intervals_markdown,
    pairwise,
    pairwise_markdown,
    path_pairs_markdown,
    same_path_markdown,
    strategy_intervals,
)
from kvtier.ab.link import link_section, peer_fetch_table, read_anchor
from kvtier.ab.rawdoc import write_raw
from kvtier.ab.records import DEFAULT_BUCKETS, REUSE_PATHS, RunResult, TurnRecord, repeat_meta
from kvtier.ab.stats import at_most, first_bucket_bound
from kvtier.ab.targets import best_single, evaluate_run
from kvtier.ab.targets import markdown as targets_markdown
from kvtier.runtime import cpu_info

PLOTS = ("ttft_vs_context.png", "prefill_split.png", "memory_over_time.png",
         "reuse_by_path.png")


def environment_meta(repo: Path | None = None) -> dict:
    """Machine (platform, CPU count, memory) and the git commit of ``repo``."""
    repo = repo or Path(__file__).resolve().parents[2]
    meta: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
            "cpu_count": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(), "processor": platform.processor() or platform.machine()}
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        meta["memory_gib"] = round(kb / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    meta.update(_cpu_info())
    meta["git_commit"] = _git(repo, "rev-parse", "HEAD")
    dirty = _git(repo, "status", "--porcelain", "--untracked-files=no")
    meta["git_dirty"] = bool(dirty) if dirty is not None else None
    if meta["git_commit"] is None and os.environ.get("KVTIER_GIT_COMMIT"):
        # a copy of the tree without .git (the lent GPU's): the caller says which commit
        meta["git_commit"] = os.environ["KVTIER_GIT_COMMIT"]
        meta["git_commit_from"] = "KVTIER_GIT_COMMIT"
    gpus = _gpus()
    if gpus:  # the card every GPU figure came from
        meta["gpus"] = gpus
    ucx = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
    if ucx:  # NIXL's transport settings change what a D->P read costs
        meta["ucx_env"] = dict(sorted(ucx.items()))
    return meta


# The ISA features CPU prefill speed hangs on (vLLM-CPU picks its kernels by them): the same
# run was ~7x slower on an AVX-512 EPYC than on an AMX Xeon, so a report must say which.
_ISA = ("amx_tile", "amx_bf16", "avx512_fp16", "avx512_bf16", "avx512f", "avx2")


def _cpu_info() -> dict:
    """CPU model and the prefill-relevant ISA flags (``kvtier.runtime.cpu_info``)."""
    model, flags = cpu_info()
    return {"cpu_model": model, "cpu_isa": [f for f in _ISA if f in flags]} if model else {}


def _gpus() -> list[str]:
    """``nvidia-smi``'s name and driver of each GPU; empty where there is none."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


# ---------------------------------------------------------------- simulator error ----
def simulation_error(measured: Sequence[RunResult], simulated: Sequence[RunResult]) -> dict:
    """Per strategy: how far the simulator's predictions are from the measured run.

    - ``ttft_mape``: mean |sim - meas| / meas over turns matched by
      (conversation, turn);
    - ``ttft_p50_rel_err``: relative error of the median TTFT;
    - ``e2e_p50_rel_err`` / ``turns_per_min_rel_err``: relative error of the median end-to-end
      time and of the throughput (where decode memory pressure shows: a turn waiting for decode
      room waits after its TTFT);
    - ``reuse_rate_abs_err``: |sim - meas| of the reuse rate;
    - ``device_block_s_rel_err`` / ``host_gb_s_rel_err``.
    """
    sim = {r.strategy: r for r in simulated}
    out: dict[str, dict] = {}
    for m in measured:
        s = sim.get(m.strategy)
        if s is None:
            continue
        st = {(t.conversation_id, t.turn): t for t in s.ok_turns}
        errs = [abs(st[k].ttft_s - t.ttft_s) / t.ttft_s
                for t in m.ok_turns
                if (k := (t.conversation_id, t.turn)) in st and t.ttft_s > 0]
        ms, ss = m.summary(), s.summary()
        out[m.strategy] = {
            "matched_turns": len(errs),
            "ttft_mape": statistics.fmean(errs) if errs else float("nan"),
            "ttft_p50_rel_err": _rel(ss["ttft_p50_s"], ms["ttft_p50_s"]),
            "e2e_p50_rel_err": _rel(ss["e2e_p50_s"], ms["e2e_p50_s"]),
            "turns_per_min_rel_err": _rel(ss["turns_per_min"], ms["turns_per_min"]),
            "reuse_rate_abs_err": abs(ss["reuse_rate"] - ms["reuse_rate"]),
            "device_block_s_rel_err": _rel(ss["device_block_s"], ms["device_block_s"]),
            "host_gb_s_rel_err": _rel(ss["host_gb_s"], ms["host_gb_s"]),
        }
    return out


def _rel(pred: float, meas: float) -> float:
    if meas == 0 or math.isnan(meas) or math.isnan(pred):
        return 0.0 if pred == meas else float("nan")
    return abs(pred - meas) / abs(meas)


# (key, column header, relative?) of the simulator's error, in table order
SIM_ERROR_METRICS = (
    ("ttft_mape", "TTFT MAPE"), ("ttft_p50_rel_err", "TTFT p50 rel. err"),
    ("e2e_p50_rel_err", "e2e p50 rel. err"), ("turns_per_min_rel_err", "turns/min rel. err"),
    ("reuse_rate_abs_err", "reuse rate abs. err"),
    ("device_block_s_rel_err", "device block·s rel. err"),
    ("host_gb_s_rel_err", "host GB·s rel. err"))


def sim_error_rows(sim_error: dict) -> list[tuple[str, str, float]]:
    """Every (strategy, metric, error) of ``simulation_error``, the worst first (NaN last)."""
    rows = [(s, label, float(e.get(k, float("nan"))))
            for s, e in sim_error.items() for k, label in SIM_ERROR_METRICS]
    return sorted(rows, key=lambda r: (math.isnan(r[2]), -r[2] if not math.isnan(r[2]) else 0))


def sim_error_section(sim_error: dict) -> list[str]:
    """The simulator's error, every strategy and metric: strategies ordered by their worst
    error, each row's worst cell in bold, and the worst rows named."""
    def worst(e: dict) -> float:
        vals = [float(e.get(k, float("nan"))) for k, _ in SIM_ERROR_METRICS]
        return max((v for v in vals if not math.isnan(v)), default=float("nan"))

    order = sorted(sim_error, key=lambda s: -worst(sim_error[s]) if not math.isnan(
        worst(sim_error[s])) else math.inf)
    lines = ["## Simulator error against this run", "",
             "Every strategy and metric; strategies ordered by their worst error, which is in "
             "bold.", "",
             "| strategy | matched turns | " + " | ".join(h for _, h in SIM_ERROR_METRICS) + " |",
             "|---|---|" + "|".join("---" for _ in SIM_ERROR_METRICS) + "|"]
    for s in order:
        e, w = sim_error[s], worst(sim_error[s])
        cells = []
        for k, _ in SIM_ERROR_METRICS:
            v = float(e.get(k, float("nan")))
            cells.append(f"**{_fmt(v, '%')}**" if v == w else _fmt(v, "%"))
        lines.append(f"| {s} | {e['matched_turns']} | " + " | ".join(cells) + " |")
    top = [r for r in sim_error_rows(sim_error) if not math.isnan(r[2])][:3]
    if top:
        lines += ["", "Worst: " + "; ".join(f"{s} {m} {_fmt(v, '%')}" for s, m, v in top) + "."]
    return lines + [""]


# ---------------------------------------------------------------- markdown ------------
def _fmt(v: object, unit: str = "") -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        if unit == "ms":
            return f"{v * 1e3:.1f}"
        if unit == "%":
            return f"{v * 100:.1f}%"
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


SUMMARY_COLUMNS = (
    ("strategy", "strategy", ""), ("turns", "turns", ""), ("errors", "errors", ""),
    ("TTFT p50 ms", "ttft_p50_s", "ms"), ("TTFT p90 ms", "ttft_p90_s", "ms"),
    ("TTFT p99 ms", "ttft_p99_s", "ms"),
    ("TTFT longest ctx ms", "ttft_longest_s", "ms"), ("e2e p50 ms", "e2e_p50_s", "ms"),
    ("turns/min", "turns_per_min", ""),
    ("computed tok", "computed_tokens", ""), ("reuse rate", "reuse_rate", "%"),
    ("hit rate", "hit_rate", "%"), ("expiry rate", "expiry_rate", "%"),
    ("device block·s", "device_block_s", ""), ("host GB·s", "host_gb_s", ""),
)


def summary_table(results: Sequence[RunResult]) -> str:
    return _summary_rows(results, SUMMARY_COLUMNS)


def _summary_rows(results: Sequence[RunResult], columns: Sequence[tuple[str, str, str]]) -> str:
    """A markdown table of each run's ``summary()``: one row a run, ``columns`` as (header,
    summary key, unit)."""
    head = "| " + " | ".join(c[0] for c in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    rows = []
    for r in results:
        s = r.summary()
        rows.append("| " + " | ".join(_fmt(s[k], u) for _, k, u in columns) + " |")
    return "\n".join([head, sep, *rows])


LOAD_COLUMNS = (
    ("strategy", "strategy", ""), ("P queue mean ms", "prefill_queue_mean_s", "ms"),
    ("P queue p90 ms", "prefill_queue_p90_s", "ms"), ("D queue mean ms", "decode_queue_mean_s", "ms"),
    ("D ITL mean ms", "decode_itl_mean_s", "ms"), ("D ITL p90 ms", "decode_itl_p90_s", "ms"),
    ("preemptions", "preemptions", ""), ("D peak running", "decode_peak_running", ""),
    ("D peak waiting", "decode_peak_waiting", ""),
    ("peak retained blocks", "device_blocks_peak", ""), ("device block·s", "device_block_s", ""),
    ("device blocks from", "device_blocks_source", ""), ("host GB·s", "host_gb_s", ""),
)


# p90 columns read from an engine histogram: (summary key) -> (role, histogram)
_HIST_P90 = {"prefill_queue_p90_s": ("prefill", "queue"), "decode_queue_p90_s": ("decode", "queue"),
             "decode_itl_p90_s": ("decode", "itl")}


def _hist_cell(r: RunResult, key: str, v: object) -> str:
    """A histogram p90 that falls inside the first bucket is "< bound" (in ms), not the linear
    estimate inside it (``kvtier.ab.stats.histogram_quantile_resolved``)."""
    if key in _HIST_P90 and isinstance(v, float) and math.isnan(v):
        role, hist = _HIST_P90[key]
        h = ((r.meta.get("engine") or {}).get(role) or {}).get(hist)
        if h:
            bound = first_bucket_bound([(float(le), float(c)) for le, c in h["buckets"]], 0.9)
            if bound is not None:
                return f"< {bound * 1e3:.0f}"
    return _fmt(v, "ms") if key in _HIST_P90 else _fmt(v)


def load_table(results: Sequence[RunResult]) -> str:
    """What the engines themselves counted (queue, inter-token latency, preemptions, running
    requests) next to the retained memory; "–" where a run did not record it."""
    head = "| " + " | ".join(c[0] for c in LOAD_COLUMNS) + " |"
    sep = "|" + "|".join("---" for _ in LOAD_COLUMNS) + "|"
    rows = []
    for r in results:
        s = r.summary()
        rows.append("| " + " | ".join(_hist_cell(r, k, s[k]) if k in _HIST_P90 else _fmt(s[k], u)
                                      for _, k, u in LOAD_COLUMNS) + " |")
    return "\n".join([head, sep, *rows])


def _slo_section(results: Sequence[RunResult], slo_s: float) -> list[str]:
    """Which strategies held the regime's TTFT p90 SLO, decided from the p90's interval."""
    lines = [f"## TTFT p90 SLO ({slo_s * 1e3:.0f} ms), from the interval", "",
             "| strategy | TTFT p90 ms [95% CI] | SLO |", "|---|---|---|"]
    mark = {True: "held", False: "**broken**", None: "not resolved"}
    for r in results:
        iv = strategy_intervals(r).ttft_p90
        lines.append(f"| {r.strategy} | {iv.fmt(1e3)} | {mark[at_most(iv, slo_s)]} |")
    return lines + [""]


def _refusal_table(results: Sequence[RunResult]) -> list[str]:
    per = {r.strategy: r.refusals() for r in results}
    reasons = sorted({k for v in per.values() for k in v})
    if not reasons:
        return []
    lines = ["## Why retained device KV was not read (router's `refusal`, follow-up turns)", "",
             "| strategy | " + " | ".join(reasons) + " |",
             "|---|" + "|".join("---" for _ in reasons) + "|"]
    lines += [f"| {s} | " + " | ".join(str(v.get(k, 0)) for k in reasons) + " |"
              for s, v in per.items()]
    return lines + [""]


def _hold_section(results: Sequence[RunResult]) -> list[str]:
    """Per strategy with decode leases: what its router chose for each conversation's turns
    (held / released at once, the hold seconds and their basis, in turn order) and the device
    block·s the decode nodes counted."""
    lines: list[str] = []
    for r in results:
        per = r.hold_choices()
        if not per:
            continue
        rr = r.meta.get("router_retention") or {}
        how = ", ".join(f"{k}={v}" for k, v in rr.items())
        lines += [f"## `{r.strategy}`: device holds chosen online, per conversation", "",
                  "The router's choice for each turn it retained under a decode lease (live: its "
                  "`served` log line; simulated: the same policy): hold the turn's device KV for "
                  "*s* seconds, or release it "
                  "at once (0), on the basis of the conversation's own waits, the fleet's, or "
                  "the default before any wait was seen." + (f" Router: {how}." if how else ""),
                  "",
                  "| conversation | turns | held | released | D->P reads | hold s by turn "
                  "(basis) |", "|---|---|---|---|---|---|"]
        for conv, c in sorted(per.items()):
            seq = ", ".join(f"#{i}: {h:.3g} ({b or '?'})" for i, h, b in c["sequence"])
            lines.append(f"| {conv} | {c['turns']} | {c['held']} | {c['released']} | "
                         f"{c['dp_reads']} | {seq} |")
        held = sum(c["held"] for c in per.values())
        rel = sum(c["released"] for c in per.values())
        mixed = [k for k, c in per.items() if c["held"] and c["released"]]
        only_held = sum(1 for c in per.values() if c["held"] and not c["released"])
        only_rel = sum(1 for c in per.values() if c["released"] and not c["held"])
        lines += ["", f"{held} turns held, {rel} released at once; conversations: {only_held} "
                  f"only held, {only_rel} only released, {len(mixed)} both. Device block·s "
                  f"{_fmt(r.device_block_seconds())} (peak {r.device_blocks_peak()} blocks; "
                  f"from {r.meta.get('device_blocks_source', 'ledger')})."]
        # the policy's own words for its latest hold and its latest release
        for label, pick in (("hold", lambda h: h > 0), ("release", lambda h: h <= 0)):
            whys = [t for t in r.turns if t.hold_why and t.hold_s is not None and pick(t.hold_s)]
            if whys:
                w = max(whys, key=lambda t: t.t_start)
                lines.append(f"- Latest {label} (`{w.conversation_id}` turn {w.turn}): "
                             f"{w.hold_why}")
        lines.append("")
    return lines


def _bucket_table(results: Sequence[RunResult]) -> str:
    per = {r.strategy: r.ttft_by_bucket(DEFAULT_BUCKETS) for r in results}
    buckets = sorted({b for v in per.values() for b in v})
    if not buckets:
        return "(no turns)"
    head = "| context ≤ tokens | " + " | ".join(per) + " |"
    sep = "|---|" + "|".join("---" for _ in per) + "|"
    rows = [f"| {b} | " + " | ".join(_fmt(per[s].get(b, float("nan")), "ms") for s in per) + " |"
            for b in buckets]
    return "\n".join([head, sep, *rows])


def markdown(results: Sequence[RunResult], meta: dict, sim_error: dict | None = None,
             simulated: Sequence[RunResult] | None = None, plots: bool = True,
             anchor: dict | None = None) -> str:
    """The run's report; ``anchor``: a device copy of the same call (``kvtier.ab.link``)."""
    env = meta.get("environment", {})
    lines = [f"# kvtier A/B report — {meta.get('trace', '?')}", ""]
    lines += [
        f"- Machine: {env.get('platform', '?')}, {env.get('cpu_count', '?')} CPUs"
        + (f" ({env['cpu_model']}; {', '.join(env.get('cpu_isa') or ['no AVX2'])})"
           if env.get("cpu_model") else "")
        + (f", {env['memory_gib']} GiB" if "memory_gib" in env else "")
        + (f"; GPU: {'; '.join(env['gpus'])}" if env.get("gpus") else ""),
        f"- Model: {meta.get('model', '?')}",
        f"- Trace: {meta.get('trace', '?')} ({meta.get('conversations', '?')} conversations, "
        f"{meta.get('turns', '?')} turns)",
        f"- Commit: {env.get('git_commit', '?')}" + (" (dirty tree)" if env.get("git_dirty") else ""),
        f"- Mode: {meta.get('mode', '?')}" + (f", time scale {meta['time_scale']}"
                                              if "time_scale" in meta else ""),
    ]
    if meta.get("topology"):
        lines.append(f"- Stack: {meta['topology']}")
    if meta.get("command"):
        lines.append(f"- Command: `{meta['command']}`")
    if meta.get("regime"):
        rg = meta["regime"]
        lines.append(f"- Regime: {rg.get('description') or '(no description)'}; settings: "
                     + ", ".join(f"{k}={v}" for k, v in rg.items() if k != "description"))
    if meta.get("repeats_completed"):
        lines += ["", f"**Interrupted run.** Repeats completed: {meta['repeats_completed']}; "
                  "only the repeats every strategy finished are in the tables (the one cut "
                  "short is in `logs/`)."]
    if meta.get("failed_strategies"):
        lines += ["", "**Incomplete run.** These strategies failed and are not in the tables "
                  "(their logs are under `logs/<strategy>/`):"]
        lines += [f"- `{k}`: {v}" for k, v in meta["failed_strategies"].items()]
    lines += ["", "## Summary", "", summary_table(results), ""]
    lines += ["## Intervals and paired ratios", "",
              "95% bootstrap intervals (seeded, `kvtier.ab.stats`). Paired ratios compare turn "
              "*i* of a conversation under A with the same turn under B in the same repeat; "
              "a verdict is given only when the whole interval is on one side of 1.", "",
              intervals_markdown(results), "", pairwise_markdown(results), ""]
    lines += ["## Targets, from this run's records (decided from the intervals)", "",
              targets_markdown(evaluate_run(results, meta)), ""]
    lines += ["## Load, latency and memory (engines' own metrics)", "", load_table(results), ""]
    slo = (meta.get("regime") or {}).get("slo_ttft_p90_s")
    if slo:
        lines += _slo_section(results, float(slo))
    lines += _stalls_section(results)
    lines += cpu_section(results)
    lines += link_section(results, meta, anchor)
    peer = peer_fetch_table(results)
    if peer:
        lines += ["## Peer fetches, as the readers timed them", "", *peer, ""]
    lines += path_cost_section(results)
    same = same_path_markdown(results)
    if same:
        lines += ["## tiered-adaptive against each strategy, on the turns both took the same way",
                  "", "Paired per-turn TTFT ratios over only the turns where both strategies "
                  "took the same reuse path (`kvtier.ab.compare.same_path`): where their choices "
                  "agree, what is left is the cost of the strategy's configuration (its engines' "
                  "connectors, its router's steps), not of its choices.", "", same, ""]
    best = best_single(results)
    cells = path_pairs_markdown(results, best)
    if cells:
        lines += [f"## tiered-adaptive against {best}, by the path each took", "",
                  "Paired per-turn TTFT ratios against the fixed strategy with the lowest "
                  "median TTFT, over every turn both completed, one row per pair of paths "
                  "(`kvtier.ab.compare.path_pairs`), with each side's median reused tokens.",
                  "", cells, ""]
    lines += _switches_section(results)
    lines += _refusal_table(results)
    lines += _hold_section(results)
    if meta.get("adaptive"):
        lines += ["## What tiered-adaptive was configured with", ""]
        for name, a in meta["adaptive"].items():
            if a.get("leases"):
                device = (f"decode leases ({a.get('decode_lease_s')} s), retention "
                          f"{a.get('retention')}, host copy {a.get('host_copy')}, cost refit "
                          f"{'on' if a.get('cost_refit') else 'off'}; vLLM TTL "
                          f"{a.get('decode_ttl_s')} s (trace seconds) as the upper bound")
            elif a.get("device_retention", True):
                device = f"decode TTL {a.get('decode_ttl_s')} s (trace seconds)"
            else:
                device = "no device retention"
            lines.append(f"- `{name}`: kv_recompute_threshold={a.get('kv_recompute_threshold')}, "
                         f"min_cached_token_delta={a.get('min_cached_token_delta')}, "
                         f"{device}. {a.get('ttl_choice', '')}")
        lines.append("")
    lines += _refit_section(results)
    lines += _repeats_section(results)
    lines += ["## Median TTFT (ms) by context length", "", _bucket_table(results), ""]
    lines += ["## Reuse by path (tokens)", "",
              "| strategy | " + " | ".join(REUSE_PATHS) + " |",
              "|---|" + "|".join("---" for _ in REUSE_PATHS) + "|"]
    for r in results:
        bp = r.reuse_by_path()
        lines.append(f"| {r.strategy} | " + " | ".join(str(bp[p]) for p in REUSE_PATHS) + " |")
    lines.append("")
    if simulated:
        lines += ["## Simulator prediction (same trace)", "", summary_table(simulated), ""]
    if sim_error:
        lines += sim_error_section(sim_error)
    if meta.get("measurement"):
        lines += ["## How each number is measured", ""]
        lines += [f"- **{k}**: {v}" for k, v in meta["measurement"].items()]
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{p}]({p})" for p in PLOTS] + [""]
    return "\n".join(lines)


# ---------------------------------------------------------------- plots ---------------
def plot_all(results: Sequence[RunResult], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []

    # 1. TTFT vs context per strategy: points and the per-bucket median.
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        ok = r.ok_turns
        pts = ax.scatter([t.prompt_tokens for t in ok], [t.ttft_s * 1e3 for t in ok],
                         s=10, alpha=0.4)
        med = _median_curve(ok)
        if med:
            ax.plot(*zip(*med), marker="o", color=pts.get_facecolor()[0][:3], label=r.strategy)
    ax.set_xlabel("prompt tokens (context)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT vs context length")
    ax.legend()
    ax.grid(alpha=0.3)
    paths.append(_save(fig, out_dir / PLOTS[0]))

    # 2. Prefill time split: mean recompute vs transfer per follow-up turn.
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [r.strategy for r in results]
    trans, comp = [], []
    for r in results:
        ok = r.ok_turns or []
        n = max(1, len(ok))
        tr = sum(t.transfer_s for t in ok) / n
        trans.append(tr * 1e3)
        comp.append(max(0.0, sum(t.ttft_s for t in ok) / n - tr) * 1e3)
    ax.bar(names, comp, label="prefill compute + overhead")
    ax.bar(names, trans, bottom=comp, label="KV transfer")
    ax.set_ylabel("mean time to first token per turn (ms)")
    ax.set_title("Prefill time: recompute vs transfer")
    ax.legend()
    paths.append(_save(fig, out_dir / PLOTS[1]))

    # 3. Retained memory over time.
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for r in results:
        ts = [s.t for s in r.memory]
        a1.step(ts, [s.device_blocks_retained for s in r.memory], where="post", label=r.strategy)
        a2.step(ts, [s.host_bytes_held / 2**20 for s in r.memory], where="post",
                label=r.strategy)
    a1.set_ylabel("device blocks retained")
    a2.set_ylabel("host MiB held")
    a2.set_xlabel("time since start (s)")
    a1.set_title("Retained KV memory over time")
    a1.legend()
    paths.append(_save(fig, out_dir / PLOTS[2]))

    # 4. Reuse by path (stacked tokens).
    fig, ax = plt.subplots(figsize=(7, 4.5))
    bottom = [0.0] * len(results)
    for p in REUSE_PATHS:
        if p == "none":
            vals = [float(sum(t.computed_tokens for t in r.ok_turns)) for r in results]
            label = "computed (prefill)"
        else:
            vals = [float(r.reuse_by_path()[p]) for r in results]
            label = f"reused via {p}"
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("prompt tokens")
    ax.set_title("Where prompt tokens came from")
    ax.legend()
    paths.append(_save(fig, out_dir / PLOTS[3]))
    return paths


def _median_curve(turns: Sequence[TurnRecord]) -> list[tuple[float, float]]:
    groups: dict[int, list] = {}
    from kvtier.ab.records import bucket_of

    for t in turns:
        groups.setdefault(bucket_of(t.prompt_tokens), []).append(t)
    out = []
    for _, ts in sorted(groups.items()):
        out.append((statistics.median(t.prompt_tokens for t in ts),
                    statistics.median(t.ttft_s for t in ts) * 1e3))
    return out


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- entry point ---------
def _repeats_section(results: Sequence[RunResult]) -> list[str]:
    """Each repeat's own numbers, so the spread between runs of one strategy is visible next
    to the differences between strategies (the summary pools the turns of all repeats)."""
    reps = [r for r in results if r.meta.get("per_repeat")]
    if not reps:
        return []
    n = max(len(r.meta["per_repeat"]) for r in reps)
    head = " / ".join(f"#{k + 1}" for k in range(n))
    lines = ["## Repeats (run interleaved; the summary pools their turns)", "",
             f"| strategy | TTFT p50 ms: {head} | device block·s: {head} | reuse rate: {head} |",
             "|---|" + "---|" * 3]
    for r in reps:
        per = r.meta["per_repeat"]
        lines.append(
            f"| {r.strategy} | " + " / ".join(f"{p['ttft_p50_s'] * 1e3:.0f}" for p in per)
            + " | " + " / ".join(f"{p['device_block_s']:,.0f}" for p in per)
            + " | " + " / ".join(f"{p['reuse_rate']:.1%}" for p in per) + " |")
    return lines + [""]


def iv_doc(s: Any) -> dict:
    return {"strategy": s.strategy, "ttft_p50_s": s.ttft_p50.to_dict(),
            "ttft_p90_s": s.ttft_p90.to_dict(), "turns_per_min": s.turns_per_min.to_dict()}


def write_report(results: Sequence[RunResult], out_dir: str | Path, meta: dict,
                 simulated: Sequence[RunResult] | None = None,
                 sim_error: dict | None = None, plots: bool = True) -> Path:
    """Write report.json.gz, report.md and the PNGs into ``out_dir``; returns report.md."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta)
    meta.setdefault("environment", environment_meta())
    if simulated and sim_error is None:
        sim_error = simulation_error(results, simulated)
    doc = {
        "meta": meta,
        "summary": [r.summary() for r in results],
        "results": msgspec.to_builtins(list(results)),
        "simulated": msgspec.to_builtins(list(simulated)) if simulated else None,
        "simulated_summary": [r.summary() for r in simulated] if simulated else None,
        "simulator_error": sim_error,
        "targets": msgspec.to_builtins(evaluate_run(results, meta)),
        "intervals": [iv_doc(strategy_intervals(r)) for r in results],
        "paired_ttft": [{"a": p.a, "b": p.b, "ratio": p.ratio.to_dict(), "verdict": p.verdict}
                        for p in pairwise(results)],
    }
    write_raw(out, doc)
    md = out / "report.md"
    md.write_text(markdown(results, meta, sim_error, simulated, plots=plots,
                           anchor=read_anchor(out)))
    if plots:
        plot_all(results, out)
    return md


def _stalls_section(results: Sequence[RunResult]) -> list[str]:
    """Each run's router process and its event-loop stalls (``meta["router_stalls"]``,
    ``meta["services"]``; one per repeat after ``merge_repeats``): "none" when there were
    none. [] for runs that did not start their router (running stacks, older reports)."""
    rows = []
    for r in results:
        stalls, services = repeat_meta(r, "router_stalls"), repeat_meta(r, "services")
        for i, st in enumerate(stalls):
            svc = services[i] if i < len(services) else None
            router = (svc or {}).get("router") or {}
            warnings = "; ".join((st or {}).get("warnings") or []) or "–"
            rows.append(f"| {r.strategy} | {i + 1} | {router.get('pid', '?')} | "
                        f"{stalls_text(st)} | {warnings} |")
    if not rows:
        return []
    return ["## Router event-loop stalls", "",
            "Each run's router is its own process (`kvtier router --config FILE`); a stall is "
            "its event loop standing still for `loop_stall_warn_s` (1 s) or more, every turn "
            "it served waiting meanwhile (`kvtier_router_event_loop_stall_seconds` at the end "
            "of the run; the warning lines from its log).", "",
            "| strategy | repeat | router pid | stalls | warnings |", "|---|---|---|---|---|",
            *rows, ""]


def cpu_records(results: Sequence[RunResult]) -> list[tuple[str, int, dict[str, Any] | None]]:
    """(strategy, repeat, ``meta["cpu"]`` or None) of every run that has the key."""
    out = []
    for r in results:
        for i, c in enumerate(repeat_meta(r, "cpu")):
            out.append((r.strategy, i + 1, c or None))
    return out


def foreign_worst(results: Sequence[RunResult]) -> str:
    """The largest foreign CPU share of any run, in words ("not recorded" without any)."""
    recs = cpu_records(results)
    shares = [float(c["foreign_share"]) for _, _, c in recs if c]
    if not shares:
        return "not recorded"
    missing = sum(1 for _, _, c in recs if not c)
    return f"{max(shares):.1%}" + (f" ({missing} run(s) not recorded)" if missing else "")


def cpu_section(results: Sequence[RunResult]) -> list[str]:
    """Each run's CPU against what else used the machine meanwhile (``meta["cpu"]``,
    ``kvtier.ab.live.cpu``; one per repeat after ``merge_repeats``). [] for runs that did not
    record it (older reports, simulations)."""
    rows = []
    for strategy, i, c in cpu_records(results):
        if not c:
            rows.append(f"| {strategy} | {i} | not recorded | | | | |")
            continue
        ours = f"{c['ours_s']:.1f}" + ("" if c.get("stack_is_ours", True)
                                       else " (stack not ours)")
        rows.append(f"| {strategy} | {i} | {c['wall_s']:.1f} | {c['machine_busy_s']:.1f} "
                    f"| {ours} | {c['foreign_s']:.1f} ({float(c['foreign_share']):.1%}) "
                    f"| {c['steal_s']:.1f} |")
    if not rows:
        return []
    head = f"The largest foreign share of any run: {foreign_worst(results)}."
    return ["## CPU used outside the run", "",
            "The machine's busy CPU over each replay (`/proc/stat`) against the CPU of the "
            "harness's process tree (itself and the stack, router and indexer it started); "
            "the rest, *foreign*, is anything else that ran on the machine meanwhile, shown "
            "with its share of the run's capacity (wall x cores), and *steal* is CPU the "
            "hypervisor gave other guests. Same work run beside foreign CPU comes out "
            "slower, so a ratio between strategies whose foreign shares differ measures the "
            "machine as well.", "", head, "",
            "| strategy | repeat | wall (s) | machine busy (CPU s) | this run's tree (CPU s) "
            "| foreign (CPU s, share) | steal (CPU s) |", "|---|---|---|---|---|---|---|",
            *rows, ""]


def path_cost_table(results: Sequence[RunResult]) -> str:
    """Median TTFT of the turns that took each reuse path, by context bucket (the router's
    estimator's buckets, ``kvtier.cost.estimator``), over every strategy's turns that were
    answered; "" without turns."""
    from kvtier.cost.estimator import bucket_label, bucket_of

    cells: dict[int, dict[str, list[float]]] = {}
    for r in results:
        for t in r.turns:
            if t.ok and t.prompt_tokens > 0:
                cells.setdefault(bucket_of(t.prompt_tokens), {}).setdefault(
                    str(t.reuse_path), []).append(t.ttft_s)
    if not cells:
        return ""
    paths = [p.value for p in REUSE_PATHS if any(p.value in c for c in cells.values())]
    rows = ["| context (tokens) | " + " | ".join(paths) + " | cheapest |",
            "|---|" + "---|" * (len(paths) + 1)]
    for b in sorted(cells):
        med = {p: statistics.median(xs) for p, xs in cells[b].items()}
        row = [f"{med[p] * 1e3:,.0f} ms (n={len(cells[b][p])})" if p in med else "–"
               for p in paths]
        cheapest = min(med, key=lambda p: med[p])
        rows.append(f"| {bucket_label(b)} | " + " | ".join(row) + f" | {cheapest} |")
    return "\n".join(rows)


def path_cost_section(results: Sequence[RunResult]) -> list[str]:
    """``path_cost_table`` with its words, or [] without turns."""
    table = path_cost_table(results)
    if not table:
        return []
    return ["## What each path cost here, by context", "",
            "Median TTFT of the turns that took each path (none: recomputed), whichever "
            "strategy took them, by the context buckets the router's estimator keeps. A "
            "strategy that chooses the path per turn (tiered-adaptive) can at best take the "
            "cheapest path of each turn, so it can beat a fixed strategy only where another "
            "path is cheaper for a share of its turns. Turns of one bucket differ in "
            "how much they reuse, so compare within a row with care.", "", table, ""]


def _switches_section(results: Sequence[RunResult]) -> list[str]:
    """When each deciding router switched a context bucket between reusing and recomputing
    (``meta["path_switches"]``, one list per repeat after ``merge_repeats``): every switch,
    with the estimates it chose by. [] where no run recorded any (fixed strategies, older
    reports)."""
    rows = []
    for r in results:
        per = r.meta.get("path_switches")
        if not per:
            continue
        if isinstance(per, list) and per and isinstance(per[0], dict):
            per = [per]
        for i, sws in enumerate(per):
            for sw in sws or []:
                exp = sw.get("expected_ms") or {}
                n = sw.get("samples") or {}
                est = ", ".join(f"{p} {ms:.0f} ms (n={n.get(p, 0)})"
                                for p, ms in sorted(exp.items(), key=lambda kv: kv[1]))
                at = sw.get("at_s")
                rows.append(f"| {r.strategy} | {i + 1} | {at if at is not None else '?'} | "
                            f"{sw.get('bucket', '?')} | {sw.get('was', '?')} -> "
                            f"{sw.get('now', '?')} ({sw.get('path', '?')}) | {est} |")
    if not rows:
        return []
    return ["## When the router switched between reusing and recomputing", "",
            "Each `path switch` line of a deciding router's log (router/costs.py): a context "
            "bucket whose cheapest path went from a read to recomputing or back, explored "
            "turns aside, with the expected TTFT of each offered path it chose by (cost model "
            "blended with the live median of that bucket's legs) and the live samples behind "
            "each.", "",
            "| strategy | repeat | at (s into the run) | context (tokens) | switch | expected "
            "TTFT by path |", "|---|---|---|---|---|---|", *rows, ""]


def stalls_text(st: dict[str, Any] | None) -> str:
    """One run's ``router_stalls`` in words: "none" when there were none."""
    if not st:
        return "not recorded"
    n = st.get("count")
    if n is None:
        seen = len(st.get("warnings") or [])
        return (f"/metrics not readable; {seen} stall warning(s) in its log" if seen
                else "/metrics not readable; none in its log")
    if n == 0:
        return "none"
    longest = st.get("longest_s")
    return (f"{n} stall(s), {st.get('total_s') or 0.0:.2f} s in all"
            + (f", longest {longest:.2f} s" if longest is not None else ""))


def _refit_section(results: Sequence[RunResult]) -> list[str]:
    """The routers' online cost refits (``cost_refit``): per repeat, how often the model was
    refitted and where its terms ended against the deployed calibration."""
    rows = []
    for r in results:
        runs = r.meta.get("router_cost")
        if isinstance(runs, dict):
            runs = [runs]
        for i, rc in enumerate(runs or []):
            if not rc:
                continue
            dep, fin = rc.get("deployed_s") or {}, rc.get("final_s") or {}
            terms = ", ".join(f"{t} {dep[t] * 1e3:.3g} → {fin.get(t, float('nan')) * 1e3:.3g} ms"
                              if not t.endswith("per_token") else
                              f"{t} {dep[t] * 1e6:.3g} → {fin.get(t, float('nan')) * 1e6:.3g} us"
                              for t in dep)
            rows.append(f"| {r.strategy} | {i + 1} | {rc.get('refits', 0):.0f} | {terms} |")
    if not rows:
        return []
    return ["## The routers' online cost refits (cost_refit)", "",
            "Deployed calibration → the model in use when the run ended "
            "(`kvtier_router_cost_model_seconds`).", "",
            "| strategy | repeat | refits | terms |", "|---|---|---|---|", *rows, ""]
