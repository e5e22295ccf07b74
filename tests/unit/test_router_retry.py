"""The router's retry policy (kvtier.router.retry), as a value and as walked per leg."""

from __future__ import annotations

import pytest

from kvtier.ids import PodId
from kvtier.router.retry import (
    ALL_FAILURES,
    Attempts,
    Exhausted,
    Failure,
    RetryPolicies,
    RetryPolicy,
)

P = RetryPolicies.from_max_retries(2)
A, B = PodId("a"), PodId("b")


def test_attempts_follow_max_retries_except_tokenize() -> None:
    for n in (0, 1, 5):
        pol = RetryPolicies.from_max_retries(n)
        assert (pol.prefill.attempts, pol.decode.attempts, pol.direct.attempts) == (n + 1,) * 3
        assert pol.tokenize.attempts == 2
    assert len(list(Attempts(P.decode))) == 3


def test_what_happens_when_attempts_run_out() -> None:
    assert P.prefill.on_exhausted is Exhausted.RECOMPUTE
    assert P.decode.on_exhausted is Exhausted.RECOMPUTE
    assert P.direct.on_exhausted is Exhausted.FAIL
    assert P.tokenize.on_exhausted is Exhausted.SKIP
    # Metric labels stay what they were.
    assert (P.prefill.leg, P.decode.leg, P.direct.leg) == ("prefill", "decode", "direct")
    assert Exhausted.RECOMPUTE.value == "recompute"


@pytest.mark.parametrize("kind,excluded", [
    (Failure.CONNECT, True), (Failure.TIMEOUT, True), (Failure.PROTOCOL, True),
    (Failure.STATUS, False),  # a 5xx may be this request's bad luck: the instance stays
])
def test_pd_legs_skip_an_instance_only_after_instance_failures(kind: Failure,
                                                              excluded: bool) -> None:
    for policy in (P.prefill, P.decode):
        run = Attempts(policy)
        run.failed(A, kind)
        assert (A in run.tried) is excluded


@pytest.mark.parametrize("policy", [P.direct, P.tokenize])
def test_direct_and_tokenize_skip_an_instance_after_any_failure(policy: RetryPolicy) -> None:
    assert policy.exclude_after == ALL_FAILURES
    run = Attempts(policy, avoid=[B])
    run.failed(A, Failure.STATUS)
    assert run.tried == {A, B}


def test_prefill_keeps_the_reuse_after_refused_connections_and_one_5xx() -> None:
    run = Attempts(P.prefill)
    for _ in range(5):
        run.failed(A, Failure.CONNECT)
    run.failed(A, Failure.STATUS)
    assert run.kv_usable
    run.failed(A, Failure.STATUS)
    assert not run.kv_usable


@pytest.mark.parametrize("kind", [Failure.TIMEOUT, Failure.PROTOCOL])
def test_a_timeout_or_broken_leg_may_have_consumed_the_kv(kind: Failure) -> None:
    for policy in (P.prefill, P.decode):
        run = Attempts(policy)
        run.failed(A, kind)
        assert not run.kv_usable
        run.failed(A, Failure.CONNECT)  # dropped for good
        assert not run.kv_usable


@pytest.mark.parametrize("first", [Failure.CONNECT, Failure.STATUS])
def test_decode_offers_the_prefills_blocks_to_the_first_retry_only(first: Failure) -> None:
    run = Attempts(P.decode)
    run.failed(A, first)
    assert run.kv_usable
    run.failed(B, Failure.CONNECT)
    assert not run.kv_usable


def test_only_the_prefill_retries_a_refusal_without_its_reuse() -> None:
    assert P.prefill.retry_refusal_without_reuse
    assert not any(p.retry_refusal_without_reuse for p in (P.decode, P.direct, P.tokenize))


def test_inconsistent_policies_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one attempt"):
        RetryPolicy("x", 0, frozenset(), Exhausted.FAIL)
    with pytest.raises(ValueError, match="free or counted"):
        RetryPolicy("x", 1, frozenset(), Exhausted.FAIL, kv_free=frozenset({Failure.STATUS}),
                    kv_counted=frozenset({Failure.STATUS}))
    recompute = RetryPolicy("direct", 1, ALL_FAILURES, Exhausted.RECOMPUTE)
    with pytest.raises(ValueError, match="cannot fall back to itself"):
        RetryPolicies(P.prefill, P.decode, recompute, P.tokenize)


def test_policies_are_frozen() -> None:
    with pytest.raises(AttributeError):
        P.prefill.attempts = 9  # type: ignore[misc]
