"""``kvtier ab --spinner-nice``: parsed once (the values ``kvtier stack place`` takes too),
handed to the local stack's placement."""

from __future__ import annotations

import argparse

import pytest

from kvtier.ab.live.ab import _spinner
from kvtier.ab.live.cli import register
from kvtier.ab.live.stacks import stack_spec_for
from kvtier.ab.strategies import builtin
from kvtier.devstack.placement import SPINNER_NICE, spinner_priority


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="cmd"))
    return p.parse_args(["ab", *argv])


def test_values_and_refusals() -> None:
    assert _parse("--spinner-nice", "19").spinner_nice == "19"
    assert _parse("--spinner-nice", "0").spinner_nice == "0"
    assert _parse("--spinner-nice", "idle").spinner_nice == "idle"
    assert _parse().spinner_nice is None
    for bad in ("20", "-1", "low"):
        with pytest.raises(SystemExit):
            _parse("--spinner-nice", bad)
    assert spinner_priority("19") == 19 and spinner_priority("idle") is None


def test_absent_keeps_the_placement_default_and_idle_is_sched_idle() -> None:
    assert _spinner(argparse.Namespace(spinner_nice=None)) == SPINNER_NICE
    assert _spinner(argparse.Namespace()) == SPINNER_NICE
    assert _spinner(argparse.Namespace(spinner_nice="19")) == 19
    assert _spinner(argparse.Namespace(spinner_nice="idle")) is None


def test_the_stack_gets_it() -> None:
    s = builtin("host-p2p")
    assert stack_spec_for(s, "m", spinner_nice=19).spinner_nice == 19
    assert stack_spec_for(s, "m").spinner_nice == SPINNER_NICE
