"""One request on its way through the P/D flow: ``Turn``, and its log fields ``TurnLog``.

``Router.handle`` (flow.py) builds a ``Turn`` from the validated request (``Inbound``), the
headers every leg sends, the caller's tenant and what the conversation store proved
(``ReuseDecision``); the prefill leg (prefill.py), the decode leg (decode.py) and the direct
leg (direct.py) read it and write what they learn on the way:

- ``ids``: the prompt's token ids, once known (from the request, ``/tokenize``, or the
  prefill's own rendering of a Responses input);
- ``report``: the ``ReuseReport`` every answer carries (headers ``x-kvtier-reuse`` /
  ``x-kvtier-outcome``), the outcome alone until a prefill leg answered;
- ``log``: the router's fields of the request's ``served`` log line.

``decision`` is what the retained turn allows, proved and confirmed before any prefill leg;
a leg that drops the reuse later (the engine refused the params) says so in ``report``, not
there: the taken turn is released for the reason of its proof (flow.py).

Threading model: a turn belongs to the one task serving its request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.ids import ConversationId, Outcome, PodId, ReusePath
from kvtier.router.plan import PlanChoice
from kvtier.router.requests import Inbound
from kvtier.router.retention import Held
from kvtier.router.store import RetainedKV, ReuseDecision
from kvtier.wire.reuse_headers import ReuseReport

NO_REUSE = ReuseDecision(Outcome.NONE, None, 0)


@dataclass(slots=True)
class TurnLog:
    """The router's fields of one ``served`` log line; a field left None is not logged."""

    reuse: str = Outcome.NONE.value  # the proof's outcome ("none": nothing retained)
    session: ConversationId | None = None
    refusal: str | None = None       # a ``reply.Refusal``: why retained KV was not read
    prefill: PodId | None = None
    path: ReusePath | None = None
    decode: PodId | None = None      # the instance that answered (decode or direct leg)
    capture: str | None = None       # "feed": D's params come from the node's params feed
    direct: str | None = None        # why the request was served on one instance
    hold: Held | None = None         # how long the retained turn is held (decode leases)
    choice: PlanChoice | None = None  # the expected costs the reuse path was chosen by
    # What the engines said, for a harness reading this line (``kvtier ab``): when the prefill
    # leg answered (``perf_counter``; the app logs it as ``prefill_ms`` since the request
    # came in), the prompt tokens the prefill did not compute (its usage's ``cached_tokens``)
    # and the tokens a non-streamed decode answer said D retained (``remote_num_tokens``).
    prefill_at: float | None = None
    cached_tokens: int | None = None
    retained_tokens: int | None = None

    def fields(self) -> dict[str, object]:
        """The line's ``extra`` fields (names as the A/B harness reads them)."""
        out: dict[str, object] = {"reuse": self.reuse}
        for name, value in (("session", self.session), ("refusal", self.refusal),
                            ("prefill", self.prefill), ("decode", self.decode),
                            ("capture", self.capture), ("direct", self.direct),
                            ("prefill_cached_tokens", self.cached_tokens),
                            ("retained_tokens", self.retained_tokens)):
            if value is not None:
                out[name] = value
        if self.path is not None:
            out["path"] = self.path.value
        if self.hold is not None:
            out.update(self.hold.fields())
        if self.choice is not None:
            out.update(self.choice.fields())
        return out


@dataclass(slots=True, eq=False)
class Turn:
    """One request's state between the legs of its answer (module docstring)."""

    inb: Inbound
    headers: dict[str, str]  # what every leg sends (``requests.forward_headers``)
    tenant: str
    conversation: ConversationId | None = None
    ids: tuple[int, ...] | None = None
    entry: RetainedKV | None = None  # the conversation's retained turn, taken from the store
    decision: ReuseDecision = NO_REUSE
    report: ReuseReport = field(default_factory=ReuseReport)
    log: TurnLog = field(default_factory=TurnLog)
    left: int = 0  # tokens the conversation's previous turn left, retained or not (0: unknown)

    def decide(self, decision: ReuseDecision, refusal: str | None = None) -> None:
        """What the retained turn allows (and, when nothing, why not): the outcome every
        answer reports unless a leg drops the reuse."""
        self.decision = decision
        self.report = ReuseReport(outcome=decision.outcome)
        self.log.reuse = decision.outcome.value
        if refusal is not None:
            self.log.refusal = refusal

    def drop_reuse(self, refusal: str) -> None:
        """A leg gave up the retained KV (the engine refused it, or rendered another
        prompt): the answer reports it ``stale``."""
        self.report = ReuseReport(outcome=Outcome.STALE)
        self.log.refusal = refusal

    @property
    def prior_tokens(self) -> int:
        """What the conversation's previous turn left (0: not a continuation): its retained
        turn's tokens, else what the router saw it leave (a turn the decode node did not
        keep)."""
        return len(self.entry.covered) if self.entry is not None else self.left
