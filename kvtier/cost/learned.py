"""The cost a deciding router learns while it serves: ``LearnedCost``, and the one path choice.

A router that decides with a cost model (tiered-adaptive) keeps it here, whether it is the live
router (``kvtier.router.costs.RouterCost``, which adds metrics and log lines around it) or the
simulator's model of that router (``kvtier.ab.sim_policy.Decisions``). Both feed it every
prefill leg they time (``observe``) and choose each turn's path with ``choose_path`` over
``decision_cost()`` and ``explore``, so ``kvtier ab --simulate`` and a live run decide with the
same code from the same samples:

- with ``refit`` (``cost_refit``), the model is refitted from those legs
  (``kvtier.cost.online.OnlineCost``);
- with ``learn`` (``cost_learn``), each leg also feeds ``kvtier.cost.estimator.PathEstimator``
  (what the leg's path really cost at its context size) and the path choice decides with the
  model in use blended with those estimates; ``explore`` gives a small counted share of
  turns to a young or stale estimate.

``LearnSettings`` holds those switches with the router's defaults (``RouterConfig``'s fields of
the same names); ``LearnSettings.of_router`` reads them from the settings a strategy hands its
router (``StrategySpec.router_settings``), so a simulated strategy learns exactly as its live
router is configured to.

Threading model: not thread-safe; one owner (a router event loop, or one simulation) per
instance. ``choose_path`` is a pure function apart from ``explore``'s counters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.cost.decide import Decision, Offer, TtftCost, decide
from kvtier.cost.estimator import EstimatedCost, PathEstimator
from kvtier.cost.model import CostModel
from kvtier.cost.online import OnlineCost
from kvtier.ids import ReusePath

# Another decision for the turn, to keep an estimate alive (``LearnedCost.explore``), or None.
Explore = Callable[[TtftCost, int, Sequence[Offer], Decision], Decision | None]


def choose_path(prompt_tokens: int, offers: Sequence[Offer], cost: TtftCost | None,
                explore: Explore | None = None, *,
                local_tokens: int = 0) -> tuple[Decision, bool]:
    """The reuse path of one turn: ``kvtier.cost.decide`` with ``cost``, then ``explore`` (when
    given, and only with a cost) may take another offer for this turn. Returns the decision
    and whether it was explored rather than the cheapest. The live router's plan
    (``kvtier.router.plan``) and the simulator both choose with this function."""
    d = decide(prompt_tokens, offers, local_tokens=local_tokens, cost=cost)
    if cost is None or explore is None:
        return d, False
    other = explore(cost, prompt_tokens, offers, d)
    return (d, False) if other is None else (other, True)


@dataclass(frozen=True)
class LearnSettings:
    """What a router learns from its prefill legs; defaults are ``RouterConfig``'s."""

    refit: bool = False           # cost_refit
    window: int = 256             # cost_refit_window
    min_samples: int = 16         # cost_refit_min_samples
    learn: bool = False           # cost_learn
    ring: int = 32                # cost_learn_ring
    explore_share: float = 0.05   # explore_share
    explore_margin: float = 0.25  # explore_margin

    @classmethod
    def of_router(cls, settings: Mapping[str, Any]) -> LearnSettings:
        """From router settings (``RouterConfig`` field names; missing keys: the defaults)."""
        d = cls()
        return cls(refit=bool(settings.get("cost_refit", d.refit)),
                   window=int(settings.get("cost_refit_window", d.window)),
                   min_samples=int(settings.get("cost_refit_min_samples", d.min_samples)),
                   learn=bool(settings.get("cost_learn", d.learn)),
                   ring=int(settings.get("cost_learn_ring", d.ring)),
                   explore_share=float(settings.get("explore_share", d.explore_share)),
                   explore_margin=float(settings.get("explore_margin", d.explore_margin)))


@dataclass(frozen=True, slots=True)
class Observed:
    """What one timed leg changed."""

    bucket: int | None  # the estimator's bucket it updated (None: not learning, or unusable)
    refitted: bool      # the refit changed the model in use


class LearnedCost:
    """The model in use (the prior, refitted online with ``refit``), the live estimates (with
    ``learn``), and the decisions made from them (module docstring)."""

    def __init__(self, model: CostModel | None, settings: LearnSettings = LearnSettings()) -> None:
        if settings.refit and model is None:
            raise ValueError("cost_refit needs a cost_model to start from")
        if settings.learn and model is None:
            raise ValueError("cost_learn needs a cost_model as its prior")
        self.settings = settings
        self.estimator = (PathEstimator(ring=settings.ring, explore_share=settings.explore_share,
                                        margin=settings.explore_margin)
                          if settings.learn else None)
        self.online = (OnlineCost(model, window=settings.window, min_samples=settings.min_samples)
                       if settings.refit and model is not None else None)
        self._model = model

    @property
    def model(self) -> CostModel | None:
        """The cost model in use: the prior, or its latest online refit."""
        return self._model

    def decision_cost(self) -> TtftCost | None:
        """What the per-turn path choice decides with: the model in use, seen through the live
        estimates when learning."""
        if self.estimator is None or self._model is None:
            return self._model
        return self.estimator.view(self._model)

    def explore(self, cost: TtftCost, prompt_tokens: int, offers: Sequence[Offer],
                chosen: Decision) -> Decision | None:
        """Another path for this turn, to keep an estimate alive; None: keep ``chosen``."""
        if self.estimator is None or not isinstance(cost, EstimatedCost):
            return None
        return self.estimator.explore(cost, prompt_tokens, offers, chosen)

    def choose(self, prompt_tokens: int, offers: Sequence[Offer], *,
               local_tokens: int = 0) -> tuple[Decision, bool]:
        """``choose_path`` with this cost's ``decision_cost`` and ``explore``."""
        return choose_path(prompt_tokens, offers, self.decision_cost(), self.explore,
                           local_tokens=local_tokens)

    def observe(self, prompt_tokens: int, path: ReusePath, reused_tokens: int,
                seconds: float) -> Observed:
        """A prefill leg answered after ``seconds``: ``reused_tokens`` of its ``prompt_tokens``
        came over ``path`` (none: 0), the rest were computed."""
        bucket = None
        if self.estimator is not None and prompt_tokens > 0:
            bucket = self.estimator.observe(path.value, prompt_tokens, seconds)
        if self.online is None or prompt_tokens <= 0:
            return Observed(bucket, False)
        reused = reused_tokens if path is not ReusePath.NONE else 0
        if not self.online.observe(prompt_tokens - reused, reused, path.value, seconds):
            return Observed(bucket, False)
        self._model = self.online.model
        return Observed(bucket, True)
