"""One prefill instance of the fleet simulator (`kvtier.ab.simulator`): its turns in service
and its own prefix cache.

A prefill instance serves the turns given to it in one of two ways (`FleetSpec.prefill_sharing`):

- FIFO: one turn at a time from `queue`, `busy` while it serves one; the simulator schedules
  each completion itself.
- Processor sharing: every turn in `active` progresses at ``rate/len(active)`` of full speed
  (``rate`` < 1 while decodes on a shared host slow the instance). Remaining work is brought
  up to date (`advance`) at every arrival and completion on the instance, and only the next
  completion is scheduled (`next_done`), tagged with `epoch` so that one superseded by a later
  change is ignored. `active` stays in arrival order, which orders completions that tie.

The prefix cache (`cache_prompt`) keeps whole prompts per conversation, least recently used
first out, within a block budget.

Threading model: plain mutable state, owned by one `_Sim` on one thread.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvtier.ids import ConversationId

# Remaining work (seconds) at or below this is done: absorbs the float drift of 1/n shares.
EPS = 1e-9


@dataclass
class PrefillJob:
    conv: ConversationId
    turn: int
    remaining: float  # service seconds left, at the full (unshared) rate


@dataclass
class PrefillInstance:
    """One prefill instance (see the module docstring)."""

    queue: deque[tuple[float, ConversationId, int]] = field(default_factory=deque)  # arrival, conv, turn
    busy: bool = False
    active: list[PrefillJob] = field(default_factory=list)
    last_update: float = 0.0
    epoch: int = 0
    rate: float = 1.0  # share of full speed the instance gets (FleetSpec.decode_interference)
    cache: OrderedDict[ConversationId, int] = field(default_factory=OrderedDict)  # conv -> tokens cached
    cache_used: int = 0

    def load(self) -> int:
        return len(self.queue) + self.busy + len(self.active)

    def advance(self, now: float) -> None:
        if self.active:
            share = (now - self.last_update) * self.rate / len(self.active)
            for job in self.active:
                job.remaining -= share
        self.last_update = now

    def admit(self, now: float, job: PrefillJob) -> None:
        self.advance(now)
        self.active.append(job)

    def take_done(self, now: float) -> list[PrefillJob]:
        self.advance(now)
        done = [j for j in self.active if j.remaining <= EPS]
        self.active = [j for j in self.active if j.remaining > EPS]
        return done

    def next_done(self) -> float | None:
        """Start a new epoch; when its first job completes if nothing arrives (None: idle)."""
        self.epoch += 1
        if not self.active:
            return None
        return self.last_update + min(j.remaining for j in self.active) * len(self.active) / self.rate

    def cache_prompt(self, conv: ConversationId, prompt: int, block_size: int,
                     capacity_blocks: int) -> None:
        """Keep ``conv``'s ``prompt`` tokens in the prefix cache (whole blocks count against
        ``capacity_blocks``), evicting the least recently cached conversations first."""
        blocks = prompt // block_size
        old = self.cache.pop(conv, 0)
        self.cache_used -= old // block_size
        while self.cache and self.cache_used + blocks > capacity_blocks:
            _, t = self.cache.popitem(last=False)
            self.cache_used -= t // block_size
        if blocks <= capacity_blocks:
            self.cache[conv] = prompt
            self.cache_used += blocks
