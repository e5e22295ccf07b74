"""The ``redis://HOST:PORT/DB`` conversation store: shared by router replicas and workers.

Same contract as the in-process store (``store.ConversationBackend``; one suite,
tests/integration/test_router_store_contract.py, runs over both). Keys, under ``namespace``
(``NS``), for tenant ``T`` and conversation ``C``:

- ``NS:e:T:C``  the entry (msgpack: decode pod, NixlParams, covered ids as uint32, digest,
  prompt length), ``PX`` = the entry's TTL, so Redis expires it on its own clock;
- ``NS:m:T:C``  a marker living one store TTL longer: a take that finds it and not the entry
  says "expired" (as the memory store does);
- ``NS:i:T:H``  per chained block digest ``H`` (``store.block_hashes``): a sorted set of
  conversations whose retained ids start with that block chain, newest first, capped and
  expiring with the entries (``find``);
- ``NS:p:POD``  the entries a decode pod holds (``discard_pod``);
- ``NS:all``    every entry by expiry (the entries gauge).

A take is one Lua script (GET + DEL of entry and marker): atomic across replicas, so one
turn reads D's KV once. A put is one Lua script too (entry, marker, indexes: one round trip). ``find`` is one Lua script too: for the prompt's block digests,
longest first, the live candidates' entries (at most ``_CANDIDATES``), proven here like the
memory store's. Memory use is Redis's (its ``maxmemory``); ``store_max_*`` do not apply.

Evictions: Redis drops entries on its own (``PX``; a ``volatile-*`` ``maxmemory`` policy), and
no router hears of it, so this store never calls the memory store's ``on_evict``. What that
leaves of a turn's decode lease: an entry's TTL is the router's ``entry_ttl_s``, which also
bounds the hold (``retention: renew`` holds for exactly that, ``adaptive`` for at most that),
so the renewing router releases a turn within one renewal round (``decode_lease_s / 3``)
after Redis expired it. An entry evicted early by ``maxmemory``, or overwritten by a newer
turn of its conversation, keeps its lease renewed until that hold ends.

Outage: every call has ``timeout_s``; a Redis error or timeout makes the call answer
"nothing" (put: not stored, take/find: none), sets ``ok`` False with the error, logs one line
on the change, and skips Redis for ``retry_s`` (each skipped call answers nothing at once).
The router serves the turn without reuse; never a 5xx.

Threading model: one asyncio event loop (the app's) per store; redis-py's asyncio client
with a bounded, blocking connection pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgspec
import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from kvtier.ids import ConversationId, PodId
from kvtier.router.store import _CANDIDATES, RetainedKV, StoreStats, block_hashes
from kvtier.transfer_params import NixlParams

log = logging.getLogger("kvtier.router")

T = TypeVar("T")

_INDEX_KEEP = 32  # newest conversations kept per block digest

# KEYS: entry, marker, all; ARGV: member of `all`. -> {1, value, pttl} | {2} (expired) | {0}
_TAKE = """
local v = redis.call('GET', KEYS[1])
if v then
  local ttl = redis.call('PTTL', KEYS[1])
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('ZREM', KEYS[3], ARGV[1])
  return {1, v, ttl}
end
if redis.call('DEL', KEYS[2]) == 1 then return {2} end
return {0}
"""

# KEYS: entry, marker, all, pod set, index keys...; ARGV: value, ttl ms, marker ttl ms,
# member, now ms, conversation, pod-set ttl ms, index keep. One round trip per put.
_PUT = """
local ttl = tonumber(ARGV[2])
local now = tonumber(ARGV[5])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('SET', KEYS[2], '1', 'PX', tonumber(ARGV[3]))
redis.call('ZADD', KEYS[3], now + ttl, ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
redis.call('SADD', KEYS[4], ARGV[4])
redis.call('PEXPIRE', KEYS[4], tonumber(ARGV[7]))
local keep = tonumber(ARGV[8])
for i = 5, #KEYS do
  redis.call('ZADD', KEYS[i], now, ARGV[6])
  redis.call('ZREMRANGEBYRANK', KEYS[i], 0, -keep - 1)
  redis.call('PEXPIRE', KEYS[i], ttl)
end
return 1
"""

# KEYS: index keys, longest prefix first; ARGV: entry key prefix, max candidates.
# -> flat {block_index, conversation, value, ...}
_FIND = """
local out = {}
local left = tonumber(ARGV[2])
for i = 1, #KEYS do
  local convs = redis.call('ZREVRANGE', KEYS[i], 0, 7)
  for _, c in ipairs(convs) do
    local v = redis.call('GET', ARGV[1] .. c)
    if v then
      table.insert(out, i)
      table.insert(out, c)
      table.insert(out, v)
      left = left - 1
      if left <= 0 then return out end
    end
  end
end
return out
"""


class RedisStore:
    name = "redis"

    def __init__(self, url: str, *, namespace: str, ttl_s: float, block_size: int,
                 timeout_s: float = 0.5, retry_s: float = 1.0,
                 on_call: Callable[[str, float | None], None] = lambda _op, _s: None,
                 max_connections: int = 64) -> None:
        self.url = url
        self.ns = namespace
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.block_size = block_size
        self.retry_s = retry_s
        self.on_call = on_call
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=timeout_s,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.redis = aioredis.Redis(connection_pool=pool)
        self._take = self.redis.register_script(_TAKE)
        self._put = self.redis.register_script(_PUT)
        self._find = self.redis.register_script(_FIND)
        self._ok = True
        self._error: str | None = None
        self._skip_until = 0.0

    # ---- health ------------------------------------------------------------
    @property
    def ok(self) -> bool:
        return self._ok

    @property
    def error(self) -> str | None:
        return self._error

    def may_hold(self) -> bool:
        return True  # other replicas write too: only a lookup can tell

    async def _call(self, op: str, fn: Callable[[], Awaitable[T]], default: T) -> T:
        """Run one Redis call; on any failure answer ``default`` and mark the store down."""
        now = time.monotonic()
        if now < self._skip_until:
            self.on_call(op, None)
            return default
        t0 = time.perf_counter()
        try:
            out = await fn()
        except (RedisError, OSError, TimeoutError) as e:
            self._skip_until = time.monotonic() + self.retry_s
            self.on_call(op, None)
            if self._ok:
                log.warning("conversation store %s unavailable (%s: %s): serving without "
                            "reuse", self.url, type(e).__name__, e)
            self._ok, self._error = False, f"{type(e).__name__}: {e}"
            return default
        self.on_call(op, time.perf_counter() - t0)
        if not self._ok:
            log.warning("conversation store %s is back", self.url)
            self._ok, self._error = True, None
        return out

    async def ping(self) -> bool:
        async def go() -> bool:
            return bool(await self.redis.ping())
        return await self._call("ping", go, False)

    # ---- keys --------------------------------------------------------------
    def _member(self, tenant: str, conv: str) -> str:
        return f"{tenant}:{conv}"

    def _entry_key(self, member: str) -> str:
        return f"{self.ns}:e:{member}"

    def _index_key(self, tenant: str, h: bytes) -> str:
        return f"{self.ns}:i:{tenant}:{h.hex()}"

    # ---- the contract ------------------------------------------------------
    async def aput(self, entry: RetainedKV) -> bool:
        ttl = max(1, int((entry.expires_at - time.monotonic()) * 1000))
        if ttl <= 1:
            return False
        ttl = min(ttl, self.ttl_ms)
        member = self._member(entry.tenant, entry.conversation)
        value = _encode(entry)
        hashes = block_hashes(_ids(entry.covered), self.block_size)
        now_ms = int(time.time() * 1000)

        keys = [self._entry_key(member), f"{self.ns}:m:{member}", f"{self.ns}:all",
                f"{self.ns}:p:{entry.decode_pod}",
                *(self._index_key(entry.tenant, h) for h in hashes)]
        args: list[bytes | str | int] = [value, ttl, ttl + self.ttl_ms, member, now_ms,
                                         entry.conversation, 2 * self.ttl_ms, _INDEX_KEEP]

        async def go() -> bool:
            await self._put(keys=keys, args=args)
            return True
        return await self._call("put", go, False)

    async def atake(self, tenant: str,
                    conversation: ConversationId) -> tuple[RetainedKV | None, bool]:
        member = self._member(tenant, conversation)
        keys = [self._entry_key(member), f"{self.ns}:m:{member}", f"{self.ns}:all"]

        async def go() -> Any:
            return await self._take(keys=keys, args=[member])
        out = await self._call("take", go, None)
        if not out:
            return None, False
        if out[0] == 2:
            return None, True
        if out[0] != 1:
            return None, False
        entry = _decode(out[1], conversation, tenant,
                        time.monotonic() + max(0, int(out[2])) / 1000)
        return entry, False

    async def afind(self, tenant: str, prompt_ids: Sequence[int]) -> ConversationId | None:
        hashes = block_hashes(prompt_ids, self.block_size)
        if not hashes:
            return None
        keys = [self._index_key(tenant, h) for h in reversed(hashes)]

        async def go() -> Any:
            return await self._find(keys=keys,
                                    args=[f"{self.ns}:e:{tenant}:", _CANDIDATES])
        out = await self._call("find", go, None)
        if not out:
            return None
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        for j in range(0, len(out), 3):
            matched = (len(hashes) - int(out[j]) + 1) * self.block_size
            conv = ConversationId(_text(out[j + 1]))
            entry = _decode(out[j + 2], conv, tenant, 0.0)
            n = entry.prompt_len
            if n > len(prompt):
                continue
            if n <= matched or np.array_equal(prompt[matched:n], entry.covered[matched:n]):
                return conv
        return None

    async def adiscard_pod(self, pod: PodId) -> int:
        pod_key = f"{self.ns}:p:{pod}"

        async def go() -> int:
            members = [_text(m) for m in await self.redis.smembers(pod_key)]
            if not members:
                return 0
            pipe = self.redis.pipeline(transaction=False)
            for m in members:
                pipe.delete(self._entry_key(m), f"{self.ns}:m:{m}")
            pipe.zrem(f"{self.ns}:all", *members)
            pipe.delete(pod_key)
            res = await pipe.execute()
            # Each DEL counts the entry and its marker: an entry is gone if either was there.
            return sum(1 for n in res[:len(members)] if n)
        return await self._call("discard", go, 0)

    async def astats(self) -> StoreStats:
        all_key = f"{self.ns}:all"

        async def go() -> int:
            pipe = self.redis.pipeline(transaction=False)
            pipe.zremrangebyscore(all_key, "-inf", int(time.time() * 1000))
            pipe.zcard(all_key)
            return int((await pipe.execute())[1])
        return StoreStats(self.name, await self._call("stats", go, 0), None)

    async def aclose(self) -> None:
        try:
            # The pool was passed in, so Redis would leave its sockets open (one per
            # connection it ever made: one contract test left 242 in the test process).
            await self.redis.aclose(close_connection_pool=True)
        except (RedisError, OSError):
            pass


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder()


def _encode(e: RetainedKV) -> bytes:
    return _ENC.encode({"d": e.decode_pod, "p": e.params.model_dump(exclude_none=True),
                        "c": np.ascontiguousarray(e.covered, dtype="<u4").tobytes(),
                        "g": e.digest, "n": e.prompt_len})


def _decode(raw: bytes, conv: ConversationId, tenant: str, expires_at: float) -> RetainedKV:
    d = _DEC.decode(raw)
    covered = np.frombuffer(d["c"], dtype="<u4").astype(np.uint32)
    return RetainedKV(conv, tenant, PodId(d["d"]), NixlParams.model_validate(d["p"]), covered,
                      d["g"], expires_at, int(d["n"]))


def _text(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v


def _ids(a: np.ndarray) -> Sequence[int]:
    return a  # type: ignore[return-value]  # block_hashes takes any int sequence
