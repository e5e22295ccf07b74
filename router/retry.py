"""Retry policy of the router's engine legs, in one place.

A ``RetryPolicy`` says, for one kind of leg: how many attempts a request gets, after which
failures the instance that failed is skipped for the rest of the request, what a failure does
to the KV the leg was offered (a D->P read for a prefill, P's prompt blocks for a decode), how
an engine's refusal (4xx) is treated, and what happens when the attempts run out.
``RetryPolicies.from_max_retries`` builds the router's four; ``Attempts`` walks one of them for
one leg of one request:

    run = Attempts(policies.decode)
    for _ in run:
        inst = pool.choose(pool.decode, exclude=run.tried)
        ...
        except UpstreamError as e:
            run.failed(inst.name, e.kind)   # then offer the KV only while run.kv_usable

A streaming leg is retried by the policy of the leg it serves (decode or direct) until its
first byte; after that bytes have reached the client, so a failure is reported in-band
(``Failure.MIDSTREAM``) and never retried.

Threading model: policies are frozen values shared by every request; an ``Attempts`` belongs
to the one task running that leg.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum

from kvtier.ids import PodId


class Failure(StrEnum):
    """Why a leg failed (``UpstreamError.kind``; the ``kind`` label of the error metric)."""

    CONNECT = "connect"      # refused: the request never reached the engine
    TIMEOUT = "timeout"      # no answer in time: the engine may still be working on it
    PROTOCOL = "protocol"    # the connection broke or the answer is not what vLLM sends
    STATUS = "status"        # the engine answered 5xx
    MIDSTREAM = "midstream"  # a streaming leg broke after its first byte (never retried)
    NO_INSTANCE = "no_instance"  # nothing left to try


ALL_FAILURES = frozenset(Failure)
# Failures that say something about the instance rather than the request.
_INSTANCE_FAILURES = frozenset({Failure.CONNECT, Failure.TIMEOUT, Failure.PROTOCOL})


class Exhausted(StrEnum):
    """What the router does when a leg's attempts run out (or no instance is left)."""

    RECOMPUTE = "recompute"  # serve the whole request on one instance, no KV moved (direct)
    FAIL = "fail"            # the client gets a 502
    SKIP = "skip"            # carry on without what the leg would have given


@dataclass(frozen=True)
class RetryPolicy:
    """How one kind of leg is retried. Failure kinds are ``Failure`` values."""

    leg: str  # the ``leg`` label of the retry metrics
    attempts: int
    # After these the failed instance is not tried again by this request.
    exclude_after: frozenset[Failure]
    on_exhausted: Exhausted
    # The KV offered to the leg lives in pinned remote blocks that a failed read may have
    # consumed. ``kv_free`` failures never reached the engine and cost nothing;
    # ``kv_counted`` ones leave the blocks pinned, and the KV is still offered after up to
    # ``kv_kept_after`` of them; any other failure drops it for the rest of the request.
    kv_kept_after: int = 0
    kv_free: frozenset[Failure] = frozenset()
    kv_counted: frozenset[Failure] = frozenset()
    # An engine's 4xx to a leg that carried reuse params may be a refusal of those params:
    # retry without them instead of relaying it (a 4xx without them goes to the client).
    retry_refusal_without_reuse: bool = False

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("a leg needs at least one attempt")
        if self.kv_free & self.kv_counted:
            raise ValueError("a failure is either free or counted for the offered KV")


@dataclass(frozen=True)
class RetryPolicies:
    """The router's policies, one per leg kind."""

    prefill: RetryPolicy
    decode: RetryPolicy
    direct: RetryPolicy
    tokenize: RetryPolicy

    def __post_init__(self) -> None:
        # Direct mode is what "recompute" runs: recomputing when it fails would never end.
        if self.direct.on_exhausted is Exhausted.RECOMPUTE:
            raise ValueError("direct mode cannot fall back to itself")

    @classmethod
    def from_max_retries(cls, max_retries: int) -> RetryPolicies:
        attempts = max_retries + 1
        return cls(
            # A 5xx from a failed D->P read (say a NIXL handshake that timed out under load)
            # leaves D's blocks pinned: offer them once more. A timeout or a broken connection
            # may have consumed them: recompute instead. The reuse params may also be what
            # the engine refused: retry without them.
            prefill=RetryPolicy(
                "prefill", attempts, _INSTANCE_FAILURES, Exhausted.RECOMPUTE,
                kv_kept_after=1, kv_free=frozenset({Failure.CONNECT}),
                kv_counted=frozenset({Failure.STATUS}), retry_refusal_without_reuse=True),
            # P keeps the prompt's blocks until a decode reads them (or its lease ends): after
            # a refused/5xx read they are still there, so the first retry reuses them; after
            # that, or after a timeout, the decode recomputes the prompt.
            decode=RetryPolicy(
                "decode", attempts, _INSTANCE_FAILURES, Exhausted.RECOMPUTE,
                kv_kept_after=1, kv_counted=frozenset({Failure.CONNECT, Failure.STATUS})),
            # The last resort: every instance that failed it in any way is skipped.
            direct=RetryPolicy("direct", attempts, ALL_FAILURES, Exhausted.FAIL),
            # Only needed to prove a prefix: one other instance, then serve without the proof.
            tokenize=RetryPolicy("tokenize", 2, ALL_FAILURES, Exhausted.SKIP),
        )


class Attempts:
    """One leg of one request under ``policy``: iterate it, report each failure."""

    def __init__(self, policy: RetryPolicy, avoid: Iterable[PodId] = ()) -> None:
        self.policy = policy
        self.tried: set[PodId] = set(avoid)  # pass as ``exclude`` to the pool's choice
        self.kv_usable = True  # whether the KV offered to this leg may still be offered
        self._counted = 0

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.policy.attempts))

    def failed(self, inst: PodId, kind: Failure) -> None:
        """Record that ``inst`` failed with ``kind``."""
        p = self.policy
        if kind in p.exclude_after:
            self.tried.add(inst)
        if kind in p.kv_free:
            return
        if kind in p.kv_counted:
            self._counted += 1
            if self._counted <= p.kv_kept_after:
                return
        self.kv_usable = False
