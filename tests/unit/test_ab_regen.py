"""`kvtier ab-report --all` (kvtier.ab.live.regen): the committed reports, regime tables, AB.md's
and the README's generated blocks equal what the command regenerates from the raw JSON, so no
stale verdict survives a change to the statistics; and the pieces it is built from."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec

from kvtier.ab.live.regen import END, load_run, regenerate, render_doc, repeats_label, run_dirs
from kvtier.ab.records import RunResult, TurnRecord
from kvtier.ab.report import load_table, sim_error_rows, sim_error_section

ROOT = Path(__file__).resolve().parents[2] / "benchmarks"


def test_committed_markdown_equals_its_regeneration() -> None:
    out = regenerate(ROOT)
    assert ROOT / "AB.md" in out and (ROOT / "../README.md") in out
    assert len([p for p in out if p.name == "report.md"]) == len(run_dirs(ROOT)) >= 20
    stale = [str(p) for p, text in out.items() if p.read_text() != text]
    assert not stale, f"run `kvtier ab-report --all benchmarks`: stale {stale}"


def test_committed_json_verdicts_equal_their_regeneration() -> None:
    for d in run_dirs(ROOT):
        run = load_run(d)
        got = msgspec.to_builtins(run.targets())
        assert json.loads(msgspec.json.encode(got)) == run.doc["targets"], d.name  # NaN: null


def test_generated_blocks_keep_the_text_around_them(tmp_path: Path) -> None:
    calls = []

    def get(p: Path):  # noqa: ANN202 - never reached: "verdicts" over an empty root
        calls.append(p)
        raise AssertionError(p)

    text = ("# hand-written\n\nkept\n\n<!-- generated: verdicts (kvtier ab-report --all) -->\n"
            "old verdicts\n" + END + "\n\nalso kept\n")
    got = render_doc(text, tmp_path, get, tmp_path)
    assert got.startswith("# hand-written\n\nkept\n\n<!-- generated: verdicts")
    assert got.endswith(END + "\n\nalso kept\n") and "old verdicts" not in got
    assert "| run |" in got and not calls
    assert render_doc(got, tmp_path, get, tmp_path) == got  # regenerating again changes nothing


def _queued(name: str, buckets: list) -> RunResult:
    t = TurnRecord(name, "c0", 0, 100, 0, "none", 100, 0.1, 0.2)
    return RunResult(name, [t], [], {"engine": {"prefill": {
        "queue": {"buckets": buckets, "sum": 0.0, "count": buckets[-1][1]}}}})


def test_a_queue_p90_inside_the_first_bucket_is_printed_as_below_its_bound() -> None:
    """vLLM's queue histogram starts at 0.3 s: every request under it used to read "270.0"."""
    inside = _queued("a", [["0.3", 40.0], ["0.5", 40.0], ["+Inf", 40.0]])
    past = _queued("b", [["0.3", 30.0], ["0.5", 40.0], ["+Inf", 40.0]])
    assert math.isnan(inside.summary()["prefill_queue_p90_s"])
    rows = {ln.split(" | ")[0]: ln.split(" | ") for ln in load_table([inside, past]).splitlines()}
    assert rows["| a"][2] == "< 300" and "270" not in load_table([inside])
    assert rows["| b"][2] == "420.0"


def test_simulator_error_lists_every_row_worst_first() -> None:
    err = {"recompute": {"matched_turns": 5, "ttft_mape": 0.1, "ttft_p50_rel_err": 0.05,
                         "reuse_rate_abs_err": 0.0, "device_block_s_rel_err": 0.0,
                         "host_gb_s_rel_err": 0.0},
           "tiered-adaptive": {"matched_turns": 5, "ttft_mape": 0.2, "ttft_p50_rel_err": 0.3,
                               "reuse_rate_abs_err": 0.01, "device_block_s_rel_err": 1.0,
                               "host_gb_s_rel_err": 0.6}}
    rows = sim_error_rows(err)
    assert len(rows) == 2 * 7  # every strategy x metric, missing ones as NaN at the end
    assert rows[0] == ("tiered-adaptive", "device block·s rel. err", 1.0)
    text = "\n".join(sim_error_section(err))
    body = [ln for ln in text.splitlines() if ln.startswith("| ") and "matched" not in ln]
    assert body[0].startswith("| tiered-adaptive |") and "**100.0%**" in body[0]
    assert "Worst: tiered-adaptive device block·s rel. err 100.0%" in text


def test_an_interrupted_runs_table_says_how_many_repeats_it_has_once():
    assert repeats_label(None, 5) == "5 repeat(s)"
    assert repeats_label("2 of 3 (interrupted)", 3) == "2 of 3 repeats, interrupted"
