"""The router's reuse headers as the A/B runner reads them (kvtier.wire.reuse_headers)."""

from __future__ import annotations

import httpx
import pytest

from kvtier.ids import Outcome, ReusePath
from kvtier.wire.reuse_headers import ReuseHeaderError, ReuseReport, parse_reuse_headers


def parse(reuse: str | None, outcome: str | None = "full") -> ReuseReport:
    h = {}
    if reuse is not None:
        h["x-kvtier-reuse"] = reuse
    if outcome is not None:
        h["x-kvtier-outcome"] = outcome
    return parse_reuse_headers(h)


@pytest.mark.parametrize("path", list(ReusePath))
@pytest.mark.parametrize("outcome", list(Outcome))
def test_every_path_and_outcome(path: ReusePath, outcome: Outcome) -> None:
    got = parse(f"{path.value}; tokens=128", outcome.value)
    assert got == ReuseReport(path, 128, outcome)
    assert got.path is path and got.outcome is outcome


def test_spacing_case_of_names_and_unknown_parameters() -> None:
    h = httpx.Headers([("X-KvTier-Reuse", " dp_read ;Tokens = 7 ; source=decode-0"),
                       ("X-KVTIER-OUTCOME", " trimmed ")])
    assert parse_reuse_headers(h) == ReuseReport(ReusePath.DP_READ, 7, Outcome.TRIMMED)
    assert parse("none;tokens=0") == ReuseReport(ReusePath.NONE, 0, Outcome.FULL)


@pytest.mark.parametrize("reuse,outcome,needle", [
    (None, "full", "no x-kvtier-reuse header"),
    ("local; tokens=3", None, "no x-kvtier-outcome header"),
    ("local", "full", "no tokens=N"),
    ("local; n=3", "full", "no tokens=N"),
    ("local; tokens", "full", "not key=value"),
    ("local; =3", "full", "not key=value"),
    ("local; tokens=", "full", "not a non-negative integer"),
    ("local; tokens=-1", "full", "not a non-negative integer"),
    ("local; tokens=1.5", "full", "not a non-negative integer"),
    ("local; tokens=\u00b2", "full", "not a non-negative integer"),
    ("disk; tokens=3", "full", "'disk' is not one of dp_read, p2p, local, none"),
    ("; tokens=3", "full", "'' is not one of"),
    ("local; tokens=3", "partial", "'partial' is not one of full, trimmed, stale, expired, none"),
])
def test_malformed_headers_say_what_is_wrong(reuse: str | None, outcome: str | None,
                                             needle: str) -> None:
    with pytest.raises(ReuseHeaderError, match=needle.replace("(", r"\(")) as e:
        parse(reuse, outcome)
    assert isinstance(e.value, ValueError)
    if reuse is not None and outcome is not None and "outcome" not in needle:
        assert "x-kvtier-" in str(e.value)


def test_a_repeated_header_is_an_error() -> None:
    h = httpx.Headers([("x-kvtier-reuse", "local; tokens=3"), ("x-kvtier-reuse", "p2p; tokens=3"),
                       ("x-kvtier-outcome", "none")])
    with pytest.raises(ReuseHeaderError, match="2 x-kvtier-reuse headers"):
        parse_reuse_headers(h)
