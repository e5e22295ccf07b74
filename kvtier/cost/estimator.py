"""What each reuse path really costs, learned from the turns a router times: ``PathEstimator``.

The calibrated ``CostModel`` is measured on an idle stack; under load its errors are large
(a live host-scarce run measured a prefill at ~89 ms whatever its length and a D->P read at
71 ms of setup, where the calibration said a read saves ~90 ms). The router times every
prefill leg, so it can learn each path's real cost and decide with that instead.

**Buckets.** A turn's context (its prompt tokens) falls in one of ``BUCKETS`` log-spaced
buckets: bucket 0 is below ``2·BASE_TOKENS``, bucket ``i`` is ``[BASE_TOKENS·2^i,
BASE_TOKENS·2^(i+1))``, the last takes everything above. Per bucket and per path (``dp_read``,
``p2p``, ``local``, ``none``) a ring of the last ``ring`` measured seconds of the prefill leg
(send to answer, queueing included: what the next turn will see).

**Estimate.** The bucket's live figure is the ring's median (robust: one stalled leg does not
move it). A turn's expected TTFT on a path blends the prior (the cost model's ``ttft_s`` for
that very turn) with the live median by sample count::

    expected = (prior_weight · prior + n · median) / (prior_weight + n),   n = samples in ring

An empty bucket is the prior; a full one (``ring`` samples) weighs the prior
``prior_weight / (prior_weight + ring)``. ``EstimatedCost`` is that estimate behind the
``ttft_s`` of a cost model, so ``kvtier.cost.decide.decide`` decides with it unchanged.

**Exploration.** A path no turn takes is never measured again. ``explore`` hands a small share
of decisions (``explore_share``: at most that share of all decisions so far, counted) to an
offered path (or recompute) whose bucket is *young* (fewer than ``min_samples``) or *stale*
(no sample in the last ``stale_after`` observations), never to one *known to be wrong*: a
bucket with at least ``min_samples`` whose estimate exceeds the chosen path's by more than
``margin`` (relative). Among candidates it takes the one with the fewest samples.

Memory: ``BUCKETS × 4 paths × ring`` floats, allocated up front; nothing grows with traffic.

Threading model: not thread-safe; one router event loop owns an instance.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.cost.decide import Decision, Offer
from kvtier.cost.model import CostModel
from kvtier.ids import ReusePath

BASE_TOKENS = 256
BUCKETS = 12  # the last bucket starts at 256·2^11 = 512k tokens
PATHS: tuple[str, ...] = tuple(p.value for p in ReusePath)


def bucket_of(prompt_tokens: int) -> int:
    """The context bucket of a prompt of ``prompt_tokens`` (module docstring)."""
    if prompt_tokens < 2 * BASE_TOKENS:
        return 0
    return min(BUCKETS - 1, int(math.log2(prompt_tokens / BASE_TOKENS)))


def bucket_label(b: int) -> str:
    """``"lo-hi"`` tokens of bucket ``b`` (``"lo+"`` for the last), for metrics and logs."""
    lo = 0 if b == 0 else BASE_TOKENS << b
    return f"{lo}+" if b == BUCKETS - 1 else f"{lo}-{(BASE_TOKENS << (b + 1)) - 1}"


class _Bucket:
    __slots__ = ("last_seen", "median", "ring")

    def __init__(self, ring: int) -> None:
        self.ring: deque[float] = deque(maxlen=ring)
        self.median = 0.0
        self.last_seen = 0  # the estimator's observation count at this bucket's last sample


@dataclass(frozen=True, slots=True)
class Estimate:
    seconds: float   # expected TTFT of the turn on this path (prior and live blended)
    prior_s: float   # what the cost model alone says
    live_s: float | None  # the bucket's median (None: no samples)
    samples: int
    stale: bool


class PathEstimator:
    def __init__(self, *, ring: int = 32, prior_weight: float = 4.0, min_samples: int = 8,
                 stale_after: int = 500, explore_share: float = 0.05,
                 margin: float = 0.25) -> None:
        if ring < 1 or min_samples < 1 or stale_after < 1:
            raise ValueError("ring, min_samples and stale_after must be >= 1")
        if prior_weight < 0 or margin < 0 or not 0.0 <= explore_share <= 1.0:
            raise ValueError("prior_weight and margin must be >= 0, explore_share in [0, 1]")
        self.ring, self.prior_weight, self.min_samples = ring, prior_weight, min_samples
        self.stale_after, self.explore_share, self.margin = stale_after, explore_share, margin
        self._b = {p: tuple(_Bucket(ring) for _ in range(BUCKETS)) for p in PATHS}
        self.seen = 0      # samples observed in all
        self.decided = 0   # decisions offered to ``explore``
        self.explored = 0  # decisions it changed

    # ---- learning -------------------------------------------------------------------
    def observe(self, path: str, prompt_tokens: int, seconds: float) -> int | None:
        """One timed prefill leg of a prompt of ``prompt_tokens`` over ``path``; the bucket
        it updated (None: not a usable sample)."""
        if prompt_tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return None
        b = bucket_of(prompt_tokens)
        per_path = self._b.get(path)
        if per_path is None:  # a bad path name is a caller bug
            raise ValueError(f"not a reuse path: {path!r}; known: {', '.join(PATHS)}")
        bk = per_path[b]
        bk.ring.append(float(seconds))
        xs = sorted(bk.ring)
        mid = len(xs) // 2
        bk.median = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
        self.seen += 1
        bk.last_seen = self.seen
        return b

    def live(self, path: str, bucket: int) -> tuple[float | None, int]:
        """The bucket's median seconds (None: empty) and its sample count."""
        bk = self._b[path][bucket]
        return (bk.median if bk.ring else None), len(bk.ring)

    def estimate(self, path: str, prompt_tokens: int, prior_s: float) -> Estimate:
        """A turn's expected TTFT on ``path``, its prior being ``prior_s``."""
        bk = self._b[path][bucket_of(prompt_tokens)]
        n = len(bk.ring)
        stale = n > 0 and self.seen - bk.last_seen >= self.stale_after
        if n == 0:
            return Estimate(prior_s, prior_s, None, 0, False)
        w = self.prior_weight
        return Estimate((w * prior_s + n * bk.median) / (w + n), prior_s, bk.median, n, stale)

    def view(self, prior: CostModel) -> EstimatedCost:
        """``prior`` with every TTFT replaced by this estimator's estimate."""
        return EstimatedCost(self, prior)

    # ---- exploring --------------------------------------------------------------------
    def explore(self, cost: EstimatedCost, prompt_tokens: int, offers: Sequence[Offer],
                chosen: Decision) -> Decision | None:
        """Another decision for this turn, to keep an estimate alive, or None (module
        docstring). Counts every call as a decision, and a returned one as explored."""
        self.decided += 1
        if self.explored + 1 > self.explore_share * self.decided or chosen.expected_s is None:
            return None
        best = chosen.expected_s
        usable = max(0, prompt_tokens - 1)
        options: list[tuple[int, int, int | None, Estimate]] = []  # samples, order, index, est
        candidates: list[tuple[int | None, str]] = [(None, ReusePath.NONE.value)]
        candidates += [(i, o.path) for i, o in enumerate(offers) if min(o.tokens, usable) > 0]
        seen_paths = set()
        for order, (i, path) in enumerate(candidates):
            if i == chosen.index or path in seen_paths or path not in self._b:
                continue
            seen_paths.add(path)
            tokens = 0 if i is None else offers[i].tokens
            e = cost.estimate(None if i is None else path, prompt_tokens, tokens)
            known_wrong = e.samples >= self.min_samples and e.seconds > best * (1 + self.margin)
            if (e.samples < self.min_samples or e.stale) and not known_wrong:
                options.append((e.samples, order, i, e))
        if not options:
            return None
        _, _, i, e = min(options, key=lambda t: (t[0], t[1]))
        self.explored += 1
        if i is None:
            return Decision(None, None, 0, e.seconds, chosen.recompute_s)
        o = offers[i]
        return Decision(i, o.path, min(o.tokens, usable), e.seconds, chosen.recompute_s)


class EstimatedCost:
    """A cost model's ``ttft_s`` answered by a ``PathEstimator`` (prior: ``prior``).

    Read paths' link models, thresholds and the rest stay the prior's (``prior``)."""

    def __init__(self, estimator: PathEstimator, prior: CostModel) -> None:
        self.estimator, self.prior = estimator, prior

    def estimate(self, path: str | None, prompt_tokens: int, reused_tokens: int, *,
                 local_tokens: int = 0) -> Estimate:
        prior_s = self.prior.ttft_s(path, prompt_tokens, reused_tokens, local_tokens=local_tokens)
        return self.estimator.estimate(path or ReusePath.NONE.value, prompt_tokens, prior_s)

    def ttft_s(self, path: str | None, prompt_tokens: int, reused_tokens: int, *,
               local_tokens: int = 0) -> float:
        return self.estimate(path, prompt_tokens, reused_tokens,
                             local_tokens=local_tokens).seconds
