"""``kvtier ab-report --all ROOT``: every committed A/B report, regenerated from its raw JSON.

Each run directory under ``ROOT/ab/`` keeps the raw records in ``report.json.gz`` (``results``,
``simulated``, ``meta``); everything a reader sees is derived from them by this checkout's code,
so a change to the statistics or to a verdict's rule reaches every report at once and no stale
verdict survives:

- ``report.md`` of every run (``kvtier.ab.report.markdown``; the simulator's error recomputed
  from the stored simulation, no refit: ``kvtier ab-report DIR`` refits and re-simulates);
- ``regime-table.md`` where a run has one (``regime_table``; its first line names the regime);
- the derived keys of ``report.json.gz`` (summary, targets, intervals, paired ratios, simulator
  error), rewritten in place by ``write_all`` (the records themselves are left as they are);
- the generated blocks of Markdown documents (``ROOT/AB.md`` and ``ROOT/../README.md``)::

      <!-- generated: KIND ARGS... (kvtier ab-report --all) -->
      ...replaced on every run...
      <!-- end generated -->

  with ``KIND`` one of ``regime-table DIR NAME``, ``demo DIR`` (the demo's closing table and
  sentences, ``kvtier.ab.live.demo.explain``), ``glance NAME=DIR...`` (the regimes at a
  glance), ``verdicts`` (every run's targets) and ``sim-errors`` (every run's simulator error,
  every strategy and metric, worst first). ``DIR`` is relative to the document's folder; text
  outside the blocks is never touched.

Resampling is seeded (``kvtier.ab.stats``), so regenerating twice gives the same bytes; a unit
test regenerates into memory and compares with what is committed.

Threading model: pure functions over files; call from one thread.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
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
from kvtier.ab.link import link_table, peer_fetch_table, read_anchor
from kvtier.ab.rawdoc import has_raw, raw_path, read_raw, write_raw
from kvtier.ab.records import RunResult
from kvtier.ab.report import (
    PLOTS,
    SIM_ERROR_METRICS,
    foreign_worst,
    iv_doc,
    load_table,
    markdown,
    simulation_error,
)
from kvtier.ab.targets import ADAPTIVE, Target, best_single, evaluate, evaluate_run
from kvtier.ab.targets import markdown as targets_markdown

DOCS = ("AB.md", "../README.md")
BEGIN = re.compile(r"^<!-- generated: (?P<args>.+?) \(kvtier ab-report --all\) -->$", re.M)
END = "<!-- end generated -->"


@dataclass
class Run:
    """One run directory's raw JSON, decoded."""

    path: Path
    doc: dict
    results: list[RunResult]
    simulated: list[RunResult] | None

    @property
    def meta(self) -> dict:
        return self.doc["meta"]

    def targets(self) -> list[Target]:
        return evaluate_run(self.results, self.meta)

    def sim_error(self) -> dict | None:
        if self.simulated:
            return simulation_error(self.results, self.simulated)
        return self.doc.get("simulator_error")


def load_run(path: Path) -> Run:
    doc = read_raw(path)
    sim = doc.get("simulated")
    return Run(path, doc, msgspec.convert(doc["results"], list[RunResult]),
               msgspec.convert(sim, list[RunResult]) if sim else None)


def run_dirs(root: Path) -> list[Path]:
    return sorted(p for p in (root / "ab").glob("*/") if has_raw(p))


def report_md(run: Run) -> str:
    plots = all((run.path / p).exists() for p in PLOTS)
    return markdown(run.results, run.meta, run.sim_error(), run.simulated, plots=plots,
                    anchor=read_anchor(run.path))


def derived(run: Run) -> dict[str, Any]:
    """The keys of ``report.json.gz`` computed from its records (``write_report``'s)."""
    return {"summary": [r.summary() for r in run.results],
            "simulated_summary": [r.summary() for r in run.simulated] if run.simulated else None,
            "simulator_error": run.sim_error(),
            "targets": msgspec.to_builtins(run.targets()),
            "intervals": [iv_doc(strategy_intervals(r)) for r in run.results],
            "paired_ttft": [{"a": p.a, "b": p.b, "ratio": p.ratio.to_dict(),
                             "verdict": p.verdict} for p in pairwise(run.results)]}


def repeats_label(completed: str | None, repeats: int) -> str:
    """How many repeats a regime table covers: "3 repeat(s)", or "2 of 3 repeats, interrupted"
    for a run cut short (its meta's ``repeats_completed`` reads "2 of 3 (interrupted)")."""
    if not completed:
        return f"{repeats} repeat(s)"
    return f"{completed.removesuffix(' (interrupted)')} repeats, interrupted"


def regime_table(name: str, run: Run) -> str:
    """One regime's tables (what ``benchmarks/ab_regimes.py table`` prints)."""
    meta, results = run.meta, run.results
    env = meta.get("environment", {})
    reps = max((int(r.meta.get("repeats", 1)) for r in results), default=1)
    out = [f"### {name}: {meta.get('trace')} (time scale {meta.get('time_scale')}, "
           + repeats_label(meta.get("repeats_completed"), reps)
           + f", commit {str(env.get('git_commit', '?'))[:10]})", "",
           intervals_markdown(results), "", pairwise_markdown(results), ""]
    same = same_path_markdown(results)
    if same:  # tiered-adaptive against each strategy, on the turns both took the same way
        out += [same, ""]
    cells = path_pairs_markdown(results, best_single(results))
    if cells:  # ... and against the best fixed strategy, by the path each took
        out += [cells, ""]
    out += [load_table(results), "", targets_markdown(run.targets()), "",
            f"Foreign CPU (other work on the machine), worst run: {foreign_worst(results)}."]
    link = link_table(results, meta, read_anchor(run.path))
    if link:  # the D->P link as the run's reads saw it, beside a device copy
        out += ["", *link]
    peer = peer_fetch_table(results)
    if peer:  # the peer fetches as their readers timed them
        out += ["", *peer]
    for k, a in (meta.get("adaptive") or {}).items():
        out += ["", f"{k}: TTL {a.get('decode_ttl_s')} s; {a.get('ttl_choice', '')}"]
    return "\n".join(out)


def _regime_name(path: Path) -> str | None:
    f = path / "regime-table.md"
    if not f.exists():
        return None
    m = re.search(r"^### (.+?):", f.read_text(), re.M)
    return m.group(1) if m else None


# ---------------------------------------------------------------- document blocks ------
def _pct(v: float) -> str:
    return "–" if math.isnan(v) else f"{v:.0%}"


def _glance(runs: list[tuple[str, Run]]) -> str:
    lines = ["| regime (run) | best single strategy (TTFT p50) | tiered-adaptive median TTFT ÷ "
             "best | TTFT p90 ÷ best | turns/min ÷ best | device block·s ÷ device-ttl's | "
             "reuse: tiered-adaptive / host-p2p | simulator TTFT p50 error, worst first | "
             "foreign CPU, worst run |",
             "|---|---|---|---|---|---|---|---|---|"]
    mark = {"met": "met", "missed": "**missed**"}
    for name, run in runs:
        t = {x.name: x for x in run.targets()}
        singles = [r for r in run.results if r.strategy != ADAPTIVE and r.ok_turns]
        best = min(singles, key=lambda r: r.summary()["ttft_p50_s"]) if singles else None
        reuse = {r.strategy: r.reuse_rate() for r in run.results}

        def cell(key: str) -> str:
            x = t[key]
            v = x.value.split("× of ")[0].split(" of its ")[0]
            return f"{v} {mark.get(x.status, x.status)}"

        errs = sorted(((e.get("ttft_p50_rel_err", math.nan), s)
                       for s, e in (run.sim_error() or {}).items()),
                      key=lambda x: -x[0] if not math.isnan(x[0]) else math.inf)
        lines.append(
            f"| {name} (`{run.path.name}`) | "
            + (f"{best.strategy} ({best.summary()['ttft_p50_s'] * 1e3:.0f} ms)" if best else "–")
            + f" | {cell('within 5% of the best single strategy')} | "
            f"{cell('TTFT p90 vs the best single strategy')} | "
            f"{cell('turns per minute vs the best single strategy')} | "
            f"{cell('device memory vs device-ttl')} | "
            + " / ".join(f"{reuse[s]:.1%}" if s in reuse else "–" for s in (ADAPTIVE, "host-p2p"))
            + " | " + (", ".join(f"{s} {_pct(v)}" for v, s in errs) or "–")
            + f" | {foreign_worst(run.results)} |")
    return "\n".join(lines)


def _verdicts(runs: list[Run]) -> str:
    names = [t.name for t in evaluate([])]
    lines = ["| run | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for run in runs:
        st = {t.name: t.status for t in run.targets()}
        lines.append(f"| `{run.path.name}` | " + " | ".join(
            "**missed**" if st[n] == "missed" else st[n] for n in names) + " |")
    return "\n".join(lines)


def _sim_errors(runs: list[Run]) -> str:
    rows = []
    for run in runs:
        for s, e in (run.sim_error() or {}).items():
            vals = [float(e.get(k, math.nan)) for k, _ in SIM_ERROR_METRICS]
            worst = max((v for v in vals if not math.isnan(v)), default=math.nan)
            rows.append((worst, run.path.name, s, vals))
    rows.sort(key=lambda r: -r[0] if not math.isnan(r[0]) else math.inf)
    lines = ["| run | strategy | " + " | ".join(h for _, h in SIM_ERROR_METRICS) + " |",
             "|---|---|" + "---|" * len(SIM_ERROR_METRICS)]
    for worst, name, s, vals in rows:
        lines.append(f"| `{name}` | {s} | " + " | ".join(
            (f"**{_pct(v)}**" if v == worst else _pct(v)) for v in vals) + " |")
    return "\n".join(lines)


def _demo(run: Run) -> str:
    from kvtier.ab.live.demo import explain

    return "```\n" + explain(run.results, int(run.meta.get("kv_bytes_per_token", 0)),
                             int(run.meta.get("block_size", 32))) + "\n```"


def render_block(args: str, here: Path, get: Callable[[Path], Run], root: Path) -> str:
    kind, *rest = args.split()
    if kind == "regime-table":
        return regime_table(rest[1], get((here / rest[0]).resolve()))
    if kind == "demo":
        return _demo(get((here / rest[0]).resolve()))
    if kind == "glance":
        pairs = [a.split("=", 1) for a in rest]
        return _glance([(n, get((here / d).resolve())) for n, d in pairs])
    if kind == "verdicts":
        return _verdicts([get(p.resolve()) for p in run_dirs(root)])
    if kind == "sim-errors":
        return _sim_errors([get(p.resolve()) for p in run_dirs(root)])
    raise ValueError(f"unknown generated block {kind!r}")


def render_doc(text: str, here: Path, get: Callable[[Path], Run], root: Path) -> str:
    """``text`` with every generated block re-rendered (text outside them kept as is)."""
    out, pos = [], 0
    for m in BEGIN.finditer(text):
        if m.start() < pos:
            continue
        end = text.find(END, m.end())
        if end < 0:
            raise ValueError(f"generated block {m.group('args')!r} has no end marker")
        out += [text[pos:m.end()], "\n", render_block(m.group("args"), here, get, root), "\n"]
        pos = end
    return "".join(out) + text[pos:]


# ---------------------------------------------------------------- entry points ---------
def regenerate(root: Path) -> dict[Path, str]:
    """Every generated Markdown file under ``root`` (and the README beside it): path -> text."""
    cache: dict[Path, Run] = {}

    def get(p: Path) -> Run:
        if p not in cache:
            cache[p] = load_run(p)
        return cache[p]

    out: dict[Path, str] = {}
    for d in run_dirs(root):
        run = get(d.resolve())
        out[d / "report.md"] = report_md(run)
        name = _regime_name(d)
        if name:
            out[d / "regime-table.md"] = regime_table(name, run) + "\n"
    for rel in DOCS:
        doc = root / rel
        if doc.exists():
            out[doc] = render_doc(doc.read_text(), doc.parent, get, root)
    return out


def write_all(root: Path) -> list[Path]:
    """Regenerate and write every file of ``regenerate``, and the derived keys of every
    ``report.json.gz``; returns the files whose contents changed."""
    changed = []
    for path, text in regenerate(root).items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(path)
    for d in run_dirs(root):
        run = load_run(d)
        doc = {**run.doc, **derived(run)}
        if write_raw(d, doc):
            changed.append(raw_path(d))
    return changed
