"""One decode pod of the fleet simulator (`kvtier.ab.simulator`): its device KV blocks, the
queue of turns waiting for them, and its host tier's copies.

A decode instance has ``capacity`` device blocks. They are used by *running* turns (admitted,
generating; a turn holds ``ceil(context/block)`` blocks until it finishes) and by *retained*
KV (a finished turn's blocks kept for the conversation's next turn under a TTL or a lease).
A turn whose prefill is done joins the instance's FIFO queue (`enqueue`); `admit` lets turns
in from the head while the head fits in the free blocks, and stops at the first that does not
(head-of-line, as vLLM's scheduler serves its waiting queue in order).

Retained blocks (``evict_retained``):

- ``False`` (pinned, vLLM's behaviour): retained KV is not freed for a waiting turn; it goes
  when its TTL or hold ends or the conversation's next prefill reads it (the caller releases
  it), and only then can the waiting turn use the room.
- ``True`` (evictable): when evicting retained KV (oldest first) would let the head of the
  queue in, it is evicted; `admit` returns the conversations it evicted.

The pod's host tier (`HostCopies`) keeps one copy per conversation (its latest context),
least recently used first out when ``capacity`` bytes are full; a copy larger than the whole
tier is not stored.

Threading model: plain mutable state, owned by one `_Sim` on one thread.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvtier.ids import ConversationId


@dataclass
class Retained:
    conv: ConversationId
    blocks: int
    tokens: int  # context tokens held (prompt + generated)
    expires: float


@dataclass
class DecodeInstance:
    capacity: int  # device KV blocks
    evict_retained: bool = False  # True: a waiting turn may evict retained KV (oldest first)
    active_blocks: int = 0  # running turns
    retained: OrderedDict[ConversationId, Retained] = field(default_factory=OrderedDict)
    retained_total: int = 0  # sum of retained[*].blocks, kept incrementally (sampled every event)
    waiting: deque[tuple[ConversationId, int, int]] = field(default_factory=deque)  # conv, turn, blocks

    def retained_blocks(self) -> int:
        return self.retained_total

    def free_blocks(self) -> int:
        return self.capacity - self.active_blocks - self.retained_total

    def retain(self, r: Retained) -> None:
        self.release(r.conv)
        self.retained[r.conv] = r
        self.retained_total += r.blocks

    def release(self, conv: ConversationId) -> None:
        r = self.retained.pop(conv, None)
        if r is not None:
            self.retained_total -= r.blocks

    def enqueue(self, conv: ConversationId, turn: int, blocks: int) -> None:
        """``turn`` of ``conv`` is ready to decode and needs ``blocks``; it waits its turn."""
        if blocks > self.capacity:
            raise ValueError(f"turn {turn} of conversation {conv} needs {blocks} KV blocks on its "
                             f"decode instance, which has {self.capacity}: it could never start")
        self.waiting.append((conv, turn, blocks))

    def admit(self) -> tuple[list[tuple[ConversationId, int, int]], list[ConversationId]]:
        """Start the waiting turns that fit, in order, stopping at the first that does not.
        Returns the turns started (their blocks now count as running) and the conversations
        whose retained KV was evicted to make room (``evict_retained`` only)."""
        started: list[tuple[ConversationId, int, int]] = []
        evicted: list[ConversationId] = []
        while self.waiting:
            conv, turn, blocks = self.waiting[0]
            if blocks > self.free_blocks():
                if not self.evict_retained or self.active_blocks + blocks > self.capacity:
                    break  # pinned retention, or running turns alone leave no room: wait
                while blocks > self.free_blocks():
                    # oldest first, the turn's own conversation last
                    victim = next((c for c in self.retained if c != conv), conv)
                    self.release(victim)
                    evicted.append(victim)
            self.waiting.popleft()
            self.active_blocks += blocks
            started.append((conv, turn, blocks))
        return started, evicted

    def finish(self, blocks: int) -> None:
        """A running turn is done; its blocks are free (the caller may retain them next)."""
        self.active_blocks -= blocks


@dataclass
class HostCopies:
    """A decode pod's host tier: conversation -> (tokens, bytes) of its latest copy, LRU."""

    capacity: int  # bytes
    used: int = 0
    copies: OrderedDict[ConversationId, tuple[int, int]] = field(default_factory=OrderedDict)  # tokens, bytes

    def store(self, conv: ConversationId, tokens: int, nbytes: int) -> None:
        self.drop(conv)
        if nbytes > self.capacity:
            return  # larger than the whole tier: not stored
        while self.used + nbytes > self.capacity:
            _, (_, b) = self.copies.popitem(last=False)  # least recently used
            self.used -= b
        self.copies[conv] = (tokens, nbytes)
        self.used += nbytes

    def lookup(self, conv: ConversationId) -> int:
        hit = self.copies.get(conv)
        if hit is None:
            return 0
        self.copies.move_to_end(conv)
        return hit[0]

    def drop(self, conv: ConversationId) -> None:
        old = self.copies.pop(conv, None)
        if old is not None:
            self.used -= old[1]
