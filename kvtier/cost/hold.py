"""Live tiered-adaptive: how long to hold each retained turn on the decode device, per turn.

With decode leases (``kvtier.leases``) a router chooses per conversation and per turn whether to
keep renewing a turn's device lease (a fast D->P read if the next turn comes soon), or to let
it go and rely on the host copy (or recompute). ``HoldPolicy`` makes that choice online from the
cost model and the tool waits the router has observed so far, with ``choose_device_ttl`` (the
same expected-gain-minus-holding-price rule the offline sweep uses):

- a conversation with at least ``min_samples`` observed waits is judged on its own waits, so a
  conversation whose tools answer in seconds is held while one that waits minutes is released;
- otherwise on the fleet's recent waits (the last ``window`` across conversations);
- with no waits yet, on ``default_hold_s``.

A choice of "do not retain" holds for 0 s (release at once). Every choice carries its inputs
(``HoldChoice``) for the router's log line and metrics.

Threading model: not thread-safe; one router event loop owns an instance.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvtier.cost.model import CostModel
from kvtier.cost.retention import MAX_TTL_S, WaitSample, choose_device_ttl


@dataclass(frozen=True)
class HoldChoice:
    hold_s: float         # renew the lease for this long after the turn, then release it
    basis: str            # "conversation" | "fleet" | "default"
    samples: int          # waits the choice was made from
    covers_wait_s: float  # the longest wait the hold is meant to cover (0: none)
    explanation: str


class HoldPolicy:
    def __init__(self, cost: CostModel, *, host_copy: bool, default_hold_s: float = MAX_TTL_S,
                 min_samples: int = 3, window: int = 512, max_conversations: int = 100_000,
                 horizon_s: float | None = None) -> None:
        if "dp_read" not in cost.reads:
            raise ValueError("the cost model has no dp_read link: nothing to hold for")
        if min_samples < 1 or window < 1:
            raise ValueError("min_samples and window must be >= 1")
        self.cost, self.host_copy = cost, host_copy
        self.default_hold_s, self.min_samples = default_hold_s, min_samples
        self.horizon_s = horizon_s
        self._fleet: deque[WaitSample] = deque(maxlen=window)
        self._conv: dict[str, deque[WaitSample]] = {}
        self._max_conv = max_conversations

    def observe(self, conversation: str, wait_s: float, tokens: int) -> None:
        """The conversation's next turn came ``wait_s`` after a turn that left ``tokens``."""
        s = WaitSample(max(0.0, wait_s), max(0, tokens))
        self._fleet.append(s)
        q = self._conv.get(conversation)
        if q is None:
            if len(self._conv) >= self._max_conv:  # forget the oldest conversation
                self._conv.pop(next(iter(self._conv)))
            q = self._conv[conversation] = deque(maxlen=32)
        q.append(s)

    def choose(self, conversation: str) -> HoldChoice:
        own = self._conv.get(conversation)
        if own is not None and len(own) >= self.min_samples:
            waits, basis = list(own), "conversation"
        elif self._fleet:
            waits, basis = list(self._fleet), "fleet"
        else:
            return HoldChoice(self.default_hold_s, "default", 0, 0.0,
                              f"no waits observed yet: hold {self.default_hold_s:g} s")
        kw = {"horizon_s": self.horizon_s} if self.horizon_s else {}
        c = choose_device_ttl(self.cost, waits, host_copy=self.host_copy, **kw)
        hold = c.ttl_s if c.retain else 0.0
        return HoldChoice(hold, basis, c.samples, c.covers_wait_s if c.retain else 0.0,
                          c.explanation)
