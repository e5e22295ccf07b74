"""The cost model the router decides with: the configured one, or that one refitted online.

With ``cost_refit`` (``RouterConfig``), every prefill leg the flow times is a sample for
``kvtier.cost.online.OnlineCost``: the prompt's tokens less those the chosen path supplied
(computed), the path and its tokens (reused), and the leg's seconds from send to answer. A
refit that changes the model is logged (``cost refit``, with the new prefill and read terms),
counted (``kvtier_router_cost_refits_total``), exposed (``kvtier_router_cost_model_seconds``:
what the model in use predicts, by term) and handed to whoever decides with it
(``on_change``: the adaptive hold policy).

With ``cost_learn``, every such leg also feeds ``kvtier.cost.estimator.PathEstimator`` (what
the leg's path really cost at its context size; ``kvtier_router_cost_estimate_seconds`` and
``_samples`` by path and bucket), and the per-turn path choice decides with ``decision_cost``:
the model in use blended with those estimates, so a path that keeps losing stops being
chosen. ``explore`` gives a small counted share of turns to a young or stale estimate
(``kvtier_router_cost_explored_total``). Without it ``decision_cost`` is the model itself.

``chose`` follows each context bucket's choice between reusing (any read path) and
recomputing, explored turns aside: when it changes, one INFO line ``path switch`` (fields
``bucket``, ``was``, ``now``, ``path``, ``expected_ms``, ``samples``: the estimates it chose
by and how many live legs stand behind each) and ``kvtier_router_cost_switches_total``. The
first choice of a bucket is not a switch. That line is how an operator (and ``kvtier ab``'s
report) sees a router learn that reading loses to recomputing, and when.

What is learned and how a turn's path is chosen is ``kvtier.cost.learned.LearnedCost``, the
same object the simulator's model of this router owns (``kvtier.ab.sim_policy``); this class
adds the metrics and log lines.

Threading model: one router event loop owns an instance.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from kvtier.cost.decide import Decision, Offer, TtftCost
from kvtier.cost.estimator import PathEstimator, bucket_label, bucket_of
from kvtier.cost.learned import LearnedCost, LearnSettings
from kvtier.cost.model import CostModel
from kvtier.cost.online import OnlineCost
from kvtier.ids import ReusePath
from kvtier.router.metrics import RouterMetrics

log = logging.getLogger("kvtier.router.costs")


class RouterCost:
    def __init__(self, model: CostModel | None, metrics: RouterMetrics, *, refit: bool = False,
                 window: int = 256, min_samples: int = 16,
                 on_change: Callable[[CostModel], None] = lambda m: None,
                 learn: bool = False, ring: int = 32, explore_share: float = 0.05,
                 explore_margin: float = 0.25) -> None:
        # what is learned and decided lives in kvtier.cost.learned, shared with the simulator
        self.learned = LearnedCost(model, LearnSettings(
            refit=refit, window=window, min_samples=min_samples, learn=learn, ring=ring,
            explore_share=explore_share, explore_margin=explore_margin))
        self.metrics = metrics
        self.on_change = on_change
        self._warned: str | None = None
        self._chosen: dict[int, str] = {}  # bucket -> "reuse" | "recompute", bounded by BUCKETS
        if model is not None:
            self._expose(model)

    @property
    def model(self) -> CostModel | None:
        return self.learned.model

    @property
    def estimator(self) -> PathEstimator | None:
        return self.learned.estimator

    @property
    def online(self) -> OnlineCost | None:
        return self.learned.online

    def decision_cost(self) -> TtftCost | None:
        """What the per-turn path choice decides with (module docstring)."""
        return self.learned.decision_cost()

    def explore(self, cost: TtftCost, prompt_tokens: int, offers: Sequence[Offer],
                chosen: Decision) -> Decision | None:
        """Another path for this turn, to keep an estimate alive; None: keep ``chosen``."""
        d = self.learned.explore(cost, prompt_tokens, offers, chosen)
        if d is not None:
            self.metrics.cost_explored.labels(d.path or ReusePath.NONE.value).inc()
        return d

    def chose(self, prompt_tokens: int, path: ReusePath, expected_s: Mapping[str, float],
              explored: bool) -> None:
        """A turn's path was chosen by cost (``PlanChoice``); log a switch (module docstring)."""
        if explored or prompt_tokens <= 0:
            return
        b = bucket_of(prompt_tokens)
        now = "recompute" if path is ReusePath.NONE else "reuse"
        was = self._chosen.get(b)
        self._chosen[b] = now
        if was is None or was == now:
            return
        label = bucket_label(b)
        self.metrics.cost_switches.labels(label, now).inc()
        est = self.learned.estimator
        samples = ({p: est.live(p, b)[1] for p in expected_s} if est is not None else {})
        log.info("path switch", extra={
            "bucket": label, "was": was, "now": now, "path": path.value,
            "prompt_tokens": prompt_tokens,
            "expected_ms": {p: round(s * 1e3, 2) for p, s in expected_s.items()},
            "samples": samples})

    def prefill_leg(self, prompt_tokens: int, path: ReusePath, reused_tokens: int,
                    seconds: float) -> None:
        """A prefill leg answered after ``seconds``: ``reused_tokens`` of its
        ``prompt_tokens`` came over ``path`` (none: 0), the rest were computed."""
        seen = self.learned.observe(prompt_tokens, path, reused_tokens, seconds)
        est = self.learned.estimator
        if est is not None and seen.bucket is not None:
            live, n = est.live(path.value, seen.bucket)
            label = bucket_label(seen.bucket)
            self.metrics.cost_estimate.labels(path.value, label).set(live or 0.0)
            self.metrics.cost_estimate_samples.labels(path.value, label).set(n)
        online = self.learned.online
        if online is None or prompt_tokens <= 0:
            return
        if not seen.refitted:
            err = online.last_error
            if err is not None and err != self._warned:  # once per failure, not per leg
                log.warning("cost refit failed; keeping the model in use: %s", err)
            self._warned = err
            return
        m = online.model
        self.metrics.cost_refits.inc()
        self._expose(m)
        reads = ", ".join(f"{p} setup {lk.setup_s * 1e3:.3g} ms" for p, lk in sorted(m.reads.items()))
        log.info("cost refit #%d over %d prefill legs: prefill %.3g ms + %.3g us/token; %s",
                 online.refits, len(online.samples), m.prefill_a_s * 1e3,
                 m.prefill_b_s_per_token * 1e6, reads)
        self.on_change(m)

    def _expose(self, m: CostModel) -> None:
        g = self.metrics.cost_model_seconds
        g.labels("prefill_fixed").set(m.prefill_a_s)
        g.labels("prefill_per_token").set(m.prefill_b_s_per_token)
        for path, link in m.reads.items():
            g.labels(f"{path}_setup").set(link.setup_s)
