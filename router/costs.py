"""The cost model the router decides with: the configured one, or that one refitted online.

With ``cost_refit`` (``RouterConfig``), every prefill leg the flow times is a sample for
``kvtier.cost.online.OnlineCost``: the prompt's tokens less those the chosen path supplied
(computed), the path and its tokens (reused), and the leg's seconds from send to answer. A
refit that changes the model is logged (``cost refit``, with the new prefill and read terms),
counted (``kvtier_router_cost_refits_total``), exposed (``kvtier_router_cost_model_seconds``:
what the model in use predicts, by term) and handed to whoever decides with it
(``on_change``: the adaptive hold policy). The per-turn path choice reads ``model`` at each
turn.

Threading model: one router event loop owns an instance.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvtier.cost.model import CostModel
from kvtier.cost.online import OnlineCost
from kvtier.ids import ReusePath
from kvtier.router.metrics import RouterMetrics

log = logging.getLogger("kvtier.router.costs")


class RouterCost:
    def __init__(self, model: CostModel | None, metrics: RouterMetrics, *, refit: bool = False,
                 window: int = 256, min_samples: int = 16,
                 on_change: Callable[[CostModel], None] = lambda m: None) -> None:
        if refit and model is None:
            raise ValueError("cost_refit needs a cost_model to start from")
        self.metrics = metrics
        self.on_change = on_change
        self.online = (OnlineCost(model, window=window, min_samples=min_samples)
                       if refit and model is not None else None)
        self._model = model
        self._warned: str | None = None
        if model is not None:
            self._expose(model)

    @property
    def model(self) -> CostModel | None:
        return self._model

    def prefill_leg(self, prompt_tokens: int, path: ReusePath, reused_tokens: int,
                    seconds: float) -> None:
        """A prefill leg answered after ``seconds``: ``reused_tokens`` of its
        ``prompt_tokens`` came over ``path`` (none: 0), the rest were computed."""
        if self.online is None or prompt_tokens <= 0:
            return
        reused = reused_tokens if path is not ReusePath.NONE else 0
        if not self.online.observe(prompt_tokens - reused, reused, path.value, seconds):
            err = self.online.last_error
            if err is not None and err != self._warned:  # once per failure, not per leg
                log.warning("cost refit failed; keeping the model in use: %s", err)
            self._warned = err
            return
        m = self._model = self.online.model
        self.metrics.cost_refits.inc()
        self._expose(m)
        reads = ", ".join(f"{p} setup {lk.setup_s * 1e3:.3g} ms" for p, lk in sorted(m.reads.items()))
        log.info("cost refit #%d over %d prefill legs: prefill %.3g ms + %.3g us/token; %s",
                 self.online.refits, len(self.online.samples), m.prefill_a_s * 1e3,
                 m.prefill_b_s_per_token * 1e6, reads)
        self.on_change(m)

    def _expose(self, m: CostModel) -> None:
        g = self.metrics.cost_model_seconds
        g.labels("prefill_fixed").set(m.prefill_a_s)
        g.labels("prefill_per_token").set(m.prefill_b_s_per_token)
        for path, link in m.reads.items():
            g.labels(f"{path}_setup").set(link.setup_s)
