"""benchmarks/AB.md says only what its regenerated tables say (issue 30): every figure its prose
quotes (a number with a decimal point, a percentage, an interval) is in one of its generated
blocks, so no stale verdict or ratio can survive a regeneration in the text around them."""

from __future__ import annotations

import re
from pathlib import Path

AB_MD = Path(__file__).resolve().parents[2] / "benchmarks" / "AB.md"
BLOCK = re.compile(r"^<!-- generated: .*?-->$(.*?)^<!-- end generated -->$", re.M | re.S)
FIGURE = re.compile(r"\d[\d,]*\.\d+%?|\d+(?:\.\d+)?%|\[[^\]]*\d[^\]]*\]")


def _prose(text: str) -> str:
    """``text`` without its generated blocks, fenced or indented code, and inline code."""
    text = BLOCK.sub("", text)
    text = re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))
    return re.sub(r"`[^`]*`", "", text)


def figures_not_in_tables(text: str) -> list[str]:
    tables = "\n".join(m.group(1) for m in BLOCK.finditer(text))
    sizing = AB_MD.parent / "sizing" / "2026-12-06-sim-regime-decode-scarce" / "sizing.md"
    tables += "\n" + sizing.read_text()  # the sizing answer the text quotes (its own test)
    return [f for f in FIGURE.findall(_prose(text))
            if not re.search(r"(?<![\d.,])" + re.escape(f) + r"(?!\d)", tables)]


def test_every_figure_in_ab_md_prose_comes_from_a_generated_table() -> None:
    assert figures_not_in_tables(AB_MD.read_text()) == []


def test_a_stale_figure_in_the_prose_is_caught() -> None:
    text = AB_MD.read_text()
    assert "1.093 [1.037, 1.140]" in BLOCK.sub("", text)  # the prose quotes a table's interval
    stale = text + "\nSession 9 measured 0.38× of host-p2p's turns per minute, 1.02 [0.95, 1.10].\n"
    assert figures_not_in_tables(stale) == ["0.38", "1.02", "[0.95, 1.10]"]
