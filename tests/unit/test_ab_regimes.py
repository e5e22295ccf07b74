"""Regime files (kvtier.ab.regimes): settings in the trace header, applied per role; the
checked-in regime files are what benchmarks/ab_regimes.py generates."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvtier.ab.live.stacks import RoleStackSpec, stack_spec_for
from kvtier.ab.regimes import RegimeSettings, read_regime, save_regime, working_set_bytes
from kvtier.ab.strategies import builtin
from kvtier.ab.traces import ConversationSpec, Trace, TurnSpec
from kvtier.devstack.spec import StackSpec

REPO = Path(__file__).resolve().parents[2]


def _trace() -> Trace:
    return Trace("t", 4096, [ConversationSpec("a", 0.0, 1, [TurnSpec(100, 10, 0.0),
                                                            TurnSpec(50, 10, 1.0)]),
                             ConversationSpec("b", 0.5, 2, [TurnSpec(200, 20, 0.0)])])


def test_settings_ride_in_the_header_and_the_file_stays_a_trace(tmp_path) -> None:
    rs = RegimeSettings(description="d", decode_num_blocks=160, host_fraction=0.5,
                        decode_env={"VLLM_CPU_KVCACHE_SPACE": "1"}, time_scale=0.5)
    p = tmp_path / "r.jsonl"
    save_regime(_trace(), rs, p)
    assert read_regime(p) == rs
    assert Trace.load(p) == _trace()
    plain = tmp_path / "plain.jsonl"
    _trace().save(plain)
    assert read_regime(plain) is None
    with pytest.raises(ValidationError):
        RegimeSettings.model_validate({"decode_blocks": 3})  # unknown keys are refused


def test_host_size_from_the_working_set() -> None:
    # a: 100+10+50+10 = 170 tokens at most; b: 220
    assert working_set_bytes(_trace(), 1000) == 390_000
    assert RegimeSettings(host_fraction=0.5).host_bytes(_trace(), 1 << 20) == 195 * (1 << 20)
    assert RegimeSettings(host_mib=8, host_fraction=0.5).host_bytes(_trace(), 1) == 8 << 20
    assert RegimeSettings().host_bytes(_trace(), 1) is None


def test_decode_capacity_reaches_decode_instances_only() -> None:
    rs = RegimeSettings(decode_num_blocks=160, decode_env={"X_KV": "1"})
    spec = stack_spec_for(builtin("device-ttl"), "/m", role_args=rs.role_args(),
                          role_env=rs.role_env())
    assert isinstance(spec, RoleStackSpec)
    by = {i.role.value: i for i in spec.instances()}
    assert by["decode"].argv()[-2:] == ["--num-gpu-blocks-override", "160"]
    assert "--num-gpu-blocks-override" not in by["prefill"].argv()
    assert by["decode"].env()["X_KV"] == "1" and "X_KV" not in by["prefill"].env()
    # no regime: the plain StackSpec, as before
    assert type(stack_spec_for(builtin("device-ttl"), "/m")) is StackSpec


def test_checked_in_regime_files_are_generated_deterministically(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("ab_regimes", REPO / "benchmarks/ab_regimes.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for p in mod.gen(tmp_path):
        checked_in = REPO / "benchmarks/traces" / p.name
        assert checked_in.read_bytes() == p.read_bytes(), p.name
        rs = read_regime(checked_in)
        assert rs is not None and rs.max_model_len is not None
        t = Trace.load(checked_in)
        assert t.vocab_size == 4096  # runs on the tiny and the bench model
    dec = read_regime(REPO / "benchmarks/traces/regime-decode-scarce.jsonl")
    assert dec is not None and dec.decode_num_blocks is not None
    assert dec.decode_num_blocks * 32 >= dec.max_model_len  # one longest request still fits
