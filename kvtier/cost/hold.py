"""Live tiered-adaptive: how long to hold each retained turn on the decode device, per turn.

With decode leases (``kvtier.leases``) a router chooses per conversation and per turn whether to
keep renewing a turn's device lease (a fast D->P read if the next turn comes soon), or to let
it go and rely on the host copy (or recompute). ``HoldPolicy`` makes that choice online from the
cost model and the tool waits the router has observed so far, with ``choose_device_ttl`` (the
same expected-gain-minus-holding-price rule the offline sweep uses):

- a conversation with at least ``min_samples`` observed waits is judged on its own waits, so a
  conversation whose tools answer in seconds is held while one that waits minutes is released;
- otherwise on the fleet's recent waits (the last ``window`` across conversations);
- with no waits yet, on ``default_hold_s`` -- unless the turn has a host copy and the cost model
  says a device read is never faster than reading that copy (``p2p`` link no slower than
  ``dp_read`` at any size, as on a CPU stack where both move DRAM over NIXL): then holding can
  gain nothing whatever the wait, and the turn is released at once. A live run where decode
  memory was scarce showed why: the default hold of every conversation's first turn filled the
  decode node and cut its turns per minute to 0.38x of ``host-p2p``'s.

**Pressure.** Device memory is priced by ``horizon_s`` (``kvtier.cost.retention``: holding a
turn that long costs as much as recomputing it). A constant price ignores whether the decode
node needs the memory now; so ``choose`` takes the node's current pressure as a factor ``f``
on that horizon (``pressure_factor``, from the node's ``vllm:kv_cache_usage_perc`` ``u`` in
[0, 1] and ``vllm:num_requests_waiting`` ``q``)::

    f(u, q) = clip((1 - u) / max(u, USAGE_FLOOR) / (1 + q / waiting_ref),
                   PRESSURE_FLOOR, PRESSURE_CEIL)
    horizon_effective = horizon_s · f        default hold = default_hold_s · min(1, f)

The price of a held second is what the memory is worth to others now: the odds that a block
is in use, ``u / (1 - u)``, times the queue. ``horizon_s`` is the price at a half-full node
with nobody waiting (f = 1); an emptier node prices holds lower (memory nobody needs costs
next to nothing: at 1% in use a held second is priced 1/99 of that), a fuller one, or one
with requests waiting for blocks, higher, so holds shorten (``choose_device_ttl``'s best TTL
never grows as the price per second rises) down to a release. A live host-scarce run showed
why the idle price matters: priced as configured on a decode node 1-3% full, the policy held
turns ~19-22 s where the waits ran to 30 s, and recomputed 11 turns that ``device-ttl``
(holding 30 s) read.

A choice of "do not retain" holds for 0 s (release at once). Every choice carries its inputs
(``HoldChoice``) for the router's log line and metrics.

Where the strategy keeps host copies, the policy does not take their survival for granted: a
host tier smaller than the working set evicts copies before their turn comes back. At every
continuation turn the caller reports whether a host tier still held the previous turn
(``observe_host``: the indexer's answer in the router, the host tiers' LRU in the simulator).
The chance that a host copy serves the next turn is then the conversation's own rate (after
``min_host_samples`` reports), else the fleet's recent rate, else 1; it weighs the fallback
(host read or recompute) that a device hold is measured against. So with ample host memory
turns are released to it, and where it is scarce the conversations whose copies do not
survive are held on the device (those whose waits are short enough to pay for it).

Threading model: not thread-safe; one router event loop owns an instance.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TypeVar

from kvtier.cost.model import CostModel
from kvtier.cost.retention import DEFAULT_HORIZON_S, MAX_TTL_S, WaitSample, choose_device_ttl

# A host copy "held" the previous turn when a host tier still has at least this share of its
# tokens (the router asks the indexer; the simulator its host tiers).
HOST_HELD_FRACTION = 0.5

_T = TypeVar("_T")

# The least share of the configured price horizon a node under pressure leaves (f > 0: a
# horizon of 0 would price every held second as infinite), and the most an idle node gives
# (a price of 0 would hold every turn as long as the store keeps it, whatever it gains).
PRESSURE_FLOOR = 0.02
PRESSURE_CEIL = 100.0
# Usage below this counts as this (an empty node: u = 0 would make the odds 0).
USAGE_FLOOR = 0.01


def pressure_factor(usage: float, waiting: float, waiting_ref: float = 4.0) -> float:
    """``f(u, q) = clip((1 - u) / max(u, USAGE_FLOOR) / (1 + q / waiting_ref), PRESSURE_FLOOR,
    PRESSURE_CEIL)`` (module docstring): 1 at half full with nobody waiting; ``usage`` is
    clipped to [0, 1] (not finite: full), ``waiting`` to >= 0 (not finite: 0)."""
    if waiting_ref <= 0:
        raise ValueError(f"waiting_ref must be > 0, got {waiting_ref}")
    u = min(1.0, max(0.0, usage)) if math.isfinite(usage) else 1.0
    q = max(0.0, waiting) if math.isfinite(waiting) else 0.0
    f = (1.0 - u) / max(u, USAGE_FLOOR) / (1.0 + q / waiting_ref)
    return min(PRESSURE_CEIL, max(PRESSURE_FLOOR, f))


@dataclass(frozen=True)
class HoldChoice:
    hold_s: float         # renew the lease for this long after the turn, then release it
    basis: str            # "conversation" | "fleet" | "default"
    samples: int          # waits the choice was made from
    covers_wait_s: float  # the longest wait the hold is meant to cover (0: none)
    explanation: str
    host_odds: float = 0.0  # the chance the choice assumed that a host copy serves the next turn
    pressure: float = 1.0   # the decode node's factor f on the price horizon (1: as configured)


class HoldPolicy:
    def __init__(self, cost: CostModel, *, host_copy: bool, default_hold_s: float = MAX_TTL_S,
                 min_samples: int = 3, window: int = 512, max_conversations: int = 100_000,
                 horizon_s: float | None = None, min_host_samples: int = 2) -> None:
        if "dp_read" not in cost.reads:
            raise ValueError("the cost model has no dp_read link: nothing to hold for")
        if min_samples < 1 or window < 1:
            raise ValueError("min_samples and window must be >= 1")
        self.cost, self.host_copy = cost, host_copy
        self.default_hold_s, self.min_samples = default_hold_s, min_samples
        self.horizon_s = horizon_s
        self.min_host_samples = max(1, min_host_samples)
        self._fleet: deque[WaitSample] = deque(maxlen=window)
        self._conv: dict[str, deque[WaitSample]] = {}
        self._max_conv = max_conversations
        # did a host tier still hold the previous turn? (fleet / per conversation)
        self._fleet_host: deque[bool] = deque(maxlen=window)
        self._conv_host: dict[str, deque[bool]] = {}

    def observe(self, conversation: str, wait_s: float, tokens: int) -> None:
        """The conversation's next turn came ``wait_s`` after a turn that left ``tokens``."""
        s = WaitSample(max(0.0, wait_s), max(0, tokens))
        self._fleet.append(s)
        self._of(self._conv, conversation, 32).append(s)

    def observe_host(self, conversation: str, held: bool) -> None:
        """At a continuation turn of ``conversation``: whether a host tier still held (most
        of) the turn before it."""
        if not self.host_copy:
            return
        self._fleet_host.append(held)
        self._of(self._conv_host, conversation, 8).append(held)

    def _of(self, per_conv: dict[str, deque[_T]], conversation: str, maxlen: int) -> deque[_T]:
        """``conversation``'s samples in ``per_conv``, made when missing (forgetting the oldest
        conversation beyond ``max_conversations``)."""
        q = per_conv.get(conversation)
        if q is None:
            if len(per_conv) >= self._max_conv:
                per_conv.pop(next(iter(per_conv)))
            q = per_conv[conversation] = deque(maxlen=maxlen)
        return q

    def host_odds(self, conversation: str) -> float:
        """The chance that a host copy serves ``conversation``'s next turn (module docstring)."""
        if not self.host_copy:
            return 0.0
        own = self._conv_host.get(conversation)
        if own is not None and len(own) >= self.min_host_samples:
            return sum(own) / len(own)
        if self._fleet_host:
            return sum(self._fleet_host) / len(self._fleet_host)
        return 1.0

    def _device_never_faster(self) -> bool:
        """A read of the host copy (``p2p``) costs no more than a device read at any size."""
        dp, host = self.cost.reads["dp_read"], self.cost.reads.get("p2p")
        return host is not None and host.setup_s <= dp.setup_s \
            and host.bytes_per_s >= dp.bytes_per_s

    def choose(self, conversation: str, pressure: float = 1.0) -> HoldChoice:
        """How long to hold ``conversation``'s turn; ``pressure``: the decode node's factor
        ``f`` (``pressure_factor``; 1: unknown, or priced as configured)."""
        f = min(PRESSURE_CEIL, max(PRESSURE_FLOOR, pressure))
        own = self._conv.get(conversation)
        if own is not None and len(own) >= self.min_samples:
            waits, basis = list(own), "conversation"
        elif self._fleet:
            waits, basis = list(self._fleet), "fleet"
        else:
            if self.host_copy and self.host_odds(conversation) >= 1.0 \
                    and self._device_never_faster():
                return HoldChoice(0.0, "default", 0, 0.0,
                                  "no waits observed yet, but a device read is never faster "
                                  "than the host copy (p2p link no slower than dp_read) -> "
                                  "no device retention", 1.0, f)
            k = min(1.0, f)  # never beyond the configured default
            hold = self.default_hold_s * k
            return HoldChoice(hold, "default", 0, 0.0,
                              f"no waits observed yet: hold {self.default_hold_s:g} s x "
                              f"pressure {k:.2g} = {hold:g} s", pressure=f)
        horizon = (self.horizon_s or DEFAULT_HORIZON_S) * f
        odds = self.host_odds(conversation)
        c = choose_device_ttl(self.cost, waits, host_copy=odds, horizon_s=horizon)
        hold = c.ttl_s if c.retain else 0.0
        why = c.explanation if f == 1.0 else (f"decode pressure {f:.2g}: horizon "
                                              f"{horizon:.3g} s; {c.explanation}")
        return HoldChoice(hold, basis, c.samples, c.covers_wait_s if c.retain else 0.0,
                          why, odds, f)
