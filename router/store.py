"""Conversation store and prefix proof: which retained KV a new turn may reuse.

After a turn, the decode node (bidirectional NixlConnector) keeps the turn's KV
(prompt + generated tokens) pinned for ``decoder_kv_blocks_ttl`` and returns
``kv_transfer_params`` naming those blocks. The router keeps, per
(tenant, conversation):

- the decode node's ``NixlParams``,
- the exact token ids that KV covers (``covered``) and their digest,
- an expiry on the router's own monotonic clock.

On the next turn ``take()`` hands the entry out once (single-use: the blocks are
freed by the first reader), and ``prove_prefix()`` checks the new prompt's token
ids against ``covered``. Only a proven common prefix is reused, trimmed to
whole blocks; anything else is dropped, because vLLM would load KV computed for
different tokens (vLLM issue #43094).

Threading model: one asyncio event loop owns a store; methods never await and
are not thread-safe. Expired entries are purged lazily on every put/take.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np

from kvtier.hashing import token_digest
from kvtier.ids import ConversationId, PodId
from kvtier.transfer_params import NixlParams

_ENTRY_OVERHEAD_BYTES = 512  # params, keys, bookkeeping; a rough, conservative figure


class ReuseOutcome(str, Enum):
    FULL = "full"          # new prompt starts with everything D holds
    TRIMMED = "trimmed"    # only a block-aligned common prefix is reused
    STALE = "stale"        # history edited before the first full block: dropped
    EXPIRED = "expired"    # entry past its TTL: dropped
    NONE = "none"          # nothing retained for this conversation


@dataclass(frozen=True)
class RetainedKV:
    """What one decode node holds for a conversation after a turn."""

    conversation: ConversationId
    tenant: str
    decode_pod: PodId
    params: NixlParams
    covered: np.ndarray  # uint32 token ids the retained KV was computed for
    digest: str
    expires_at: float  # router monotonic clock

    @classmethod
    def build(cls, conversation: ConversationId, tenant: str, decode_pod: PodId,
              params: NixlParams, token_ids: Sequence[int], expires_at: float) -> "RetainedKV":
        # D computed KV for remote_num_tokens tokens (the last sampled token never
        # went through the model); cover exactly those.
        n = len(token_ids)
        if params.remote_num_tokens is not None:
            n = min(n, params.remote_num_tokens)
        covered = np.asarray(token_ids[:n], dtype=np.uint32)
        return cls(conversation, tenant, decode_pod, params, covered,
                   token_digest(covered), expires_at)

    @property
    def nbytes(self) -> int:
        return int(self.covered.nbytes) + _ENTRY_OVERHEAD_BYTES


@dataclass(frozen=True)
class ReuseDecision:
    outcome: ReuseOutcome
    params: NixlParams | None  # what to hand the prefill (None: nothing)
    reused_tokens: int  # tokens of D's KV the prefill may read


def prove_prefix(retained: RetainedKV, prompt_ids: Sequence[int], block_size: int) -> ReuseDecision:
    """Check ``prompt_ids`` starts with the retained ids; trim or drop otherwise."""
    covered = retained.covered
    n = len(covered)
    if n == 0 or not retained.params.has_remote_blocks:
        return ReuseDecision(ReuseOutcome.STALE, None, 0)
    prompt = np.asarray(prompt_ids, dtype=np.int64)
    if len(prompt) >= n and np.array_equal(prompt[:n], covered) \
            and token_digest(prompt[:n]) == retained.digest:
        if len(prompt) > n:
            return ReuseDecision(ReuseOutcome.FULL, retained.params, n)
        # The new prompt IS the covered sequence (nothing new to compute): the
        # engine must still run the last token, so keep whole blocks before it.
        common = n - 1
    else:
        common = _common_prefix(covered, prompt)
    trimmed = retained.params.trimmed(common, block_size)
    if trimmed is None:
        return ReuseDecision(ReuseOutcome.STALE, None, 0)
    return ReuseDecision(ReuseOutcome.TRIMMED, trimmed, trimmed.remote_num_tokens or 0)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(a[:n].astype(np.int64) != b[:n])[0]
    return int(diff[0]) if len(diff) else n



class ConversationStore:
    """Single-use, TTL'd, LRU, memory-capped map (tenant, conversation) -> RetainedKV."""

    def __init__(self, max_entries: int, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[tuple[str, ConversationId], RetainedKV] = OrderedDict()
        self._bytes = 0
        self.evicted = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def put(self, entry: RetainedKV) -> bool:
        """Store (replacing any older entry); False if it alone exceeds the cap."""
        if entry.nbytes > self.max_bytes:
            return False
        key = (entry.tenant, entry.conversation)
        self._drop(key)
        self._purge_expired()
        while self._entries and (len(self._entries) >= self.max_entries
                                 or self._bytes + entry.nbytes > self.max_bytes):
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.nbytes
            self.evicted += 1
        self._entries[key] = entry
        self._bytes += entry.nbytes
        return True

    def take(self, tenant: str, conversation: ConversationId) -> tuple[RetainedKV | None, bool]:
        """Remove and return the entry: (entry, expired). Single use."""
        entry = self._drop((tenant, conversation))
        if entry is None:
            return None, False
        if entry.expires_at <= self._clock():
            self.expired += 1
            return None, True
        return entry, False

    def discard_pod(self, pod: PodId) -> int:
        """Forget every entry held by a pod (it died: its KV is gone)."""
        keys = [k for k, e in self._entries.items() if e.decode_pod == pod]
        for k in keys:
            self._drop(k)
        return len(keys)

    def _drop(self, key: tuple[str, ConversationId]) -> RetainedKV | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes
        return entry

    def _purge_expired(self) -> None:
        now = self._clock()
        # Entries are stored in insertion order with one TTL, so expired ones
        # sit at the front; stop at the first live one.
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.expires_at > now:
                break
            self._drop(key)
            self.expired += 1
