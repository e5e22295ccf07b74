"""The ``redis://HOST:PORT/DB`` conversation store: shared by router replicas and workers.

Same contract as the in-process store (``store.ConversationBackend``; one suite,
tests/integration/test_router_store_contract.py, runs over both). Keys, under ``namespace``
(``NS``), for tenant ``T`` and conversation ``C``:

- ``NS:ev:T:C`` the entry: its version (``_VER_LEN`` bytes, unique per write), then msgpack
  (decode pod, NixlParams, covered ids as uint32, digest, prompt length); ``PX`` = the
  entry's TTL, so Redis expires it on its own clock;
- ``NS:m:T:C``  a marker living one store TTL longer: a take that finds it and not the entry
  says "expired" (as the memory store does);
- ``NS:i:T:H``  per chained block digest ``H`` (``store.block_hashes``): a sorted set of
  conversations whose retained ids start with that block chain, newest first, capped and
  expiring with the entries (``find``);
- ``NS:p:POD``  the entries a decode pod holds (``discard_pod``);
- ``NS:all``    every entry by expiry (the entries gauge).

One round trip per operation, each one Lua script where it must be atomic: a take (GET + DEL
of entry and marker: atomic across replicas, so one turn reads D's KV once), a put (entry,
marker, indexes), a find (for the prompt's block digests, longest first, the live
candidates' entries, at most ``_CANDIDATES``, proven here like the memory store's), a pod's
discard. Calls go through one pipelined connection (``redis_conn.py``: redis-py's asyncio
client cost ~3x per call). Memory use in Redis is Redis's (its ``maxmemory``).

Off the request path where it can be:

- **Write after the answer** (``put_soon``): the router's put is written to the socket at once
  and not awaited, so the client's answer never waits for it; the connection keeps the order,
  so this process's next lookup sees it, and it reaches Redis before the client can send its
  next turn to another replica. A write that fails is counted (``on_call("put", None)``:
  ``kvtier_router_store_errors_total{op="put"}``), logged, and handed to ``on_evict``, which
  releases its decode lease (nobody will offer the blocks).
- **A local read-through copy** of every entry this process wrote or decoded (``_Recent``,
  capped by ``store_max_entries`` / ``store_max_bytes``), each with the version it had in
  Redis. A copy is never used on its own word: a take sends the copy's version and Redis,
  inside the take script, answers "same version" (no value sent, nothing decoded) or the
  current value, so another replica's newer write always wins; a find's candidate is decoded
  only when its version differs from the copy's.

Evictions: Redis drops entries on its own (``PX``; a ``volatile-*`` ``maxmemory`` policy), and
no router hears of it, so this store calls ``on_evict`` only for its own failed writes. What
that leaves of a turn's decode lease: an entry's TTL is the router's ``entry_ttl_s``, which
also bounds the hold (``retention: renew`` holds for exactly that, ``adaptive`` for at most
that), so the renewing router releases a turn within one renewal round (``decode_lease_s /
3``) after Redis expired it. An entry evicted early by ``maxmemory``, or overwritten by a
newer turn of its conversation, keeps its lease renewed until that hold ends.

Outage: every call has ``timeout_s``; a Redis error or timeout makes the call answer
"nothing" (put: not stored, take/find: none), sets ``ok`` False with the error, logs one line
on the change, and skips Redis for ``retry_s`` (each skipped call answers nothing at once).
The router serves the turn without reuse; never a 5xx.

Threading model: one asyncio event loop (the app's) per store; one connection, pipelined.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import msgspec
import numpy as np

from kvtier.ids import ConversationId, PodId
from kvtier.router.redis_conn import RedisConn, ReplyError, Script
from kvtier.router.store import _CANDIDATES, RetainedKV, StoreStats, block_hashes
from kvtier.transfer_params import NixlParams

log = logging.getLogger("kvtier.router")

T = TypeVar("T")

_INDEX_KEEP = 32  # newest conversations kept per block digest
_VER_LEN = 20  # bytes of an entry's version: 12 hex digits per store instance + 8 per write
_Key = tuple[str, str]  # (tenant, conversation)

# KEYS: entry, marker, all; ARGV: member of `all`, the version of the caller's copy ('' none).
# -> {1, value, pttl} | {3, pttl} (the copy's version: no value) | {2} (expired) | {0}
_TAKE = Script("""
local v = redis.call('GET', KEYS[1])
if v then
  local ttl = redis.call('PTTL', KEYS[1])
  redis.call('DEL', KEYS[1], KEYS[2])
  redis.call('ZREM', KEYS[3], ARGV[1])
  if ARGV[2] ~= '' and string.sub(v, 1, #ARGV[2]) == ARGV[2] then return {3, ttl} end
  return {1, v, ttl}
end
if redis.call('DEL', KEYS[2]) == 1 then return {2} end
return {0}
""")

# KEYS: entry, marker, all, pod set, index keys...; ARGV: value, ttl ms, marker ttl ms,
# member, now ms, conversation, pod-set ttl ms, index keep.
_PUT = Script("""
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
""")

# KEYS: index keys, longest prefix first; ARGV: entry key prefix, max candidates.
# -> flat {block_index, conversation, value, pttl, ...}
_FIND = Script("""
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
      table.insert(out, redis.call('PTTL', ARGV[1] .. c))
      left = left - 1
      if left <= 0 then return out end
    end
  end
end
return out
""")

# KEYS: pod set, all; ARGV: namespace. -> entries that were there (entry or marker)
_DISCARD = Script("""
local members = redis.call('SMEMBERS', KEYS[1])
local n = 0
for _, m in ipairs(members) do
  if redis.call('DEL', ARGV[1] .. ':ev:' .. m, ARGV[1] .. ':m:' .. m) > 0 then n = n + 1 end
  redis.call('ZREM', KEYS[2], m)
end
redis.call('DEL', KEYS[1])
return n
""")


class _Recent:
    """This process's copies of entries it wrote or decoded, by (tenant, conversation), each
    with its version in Redis; least recently used first out, capped in entries and bytes.
    A copy is only ever used when Redis confirms its version (module docstring)."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._d: OrderedDict[_Key, tuple[bytes, RetainedKV]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._d)

    def put(self, key: _Key, version: bytes, entry: RetainedKV) -> None:
        self.pop(key)
        if entry.nbytes > self.max_bytes:
            return
        self._d[key] = (version, entry)
        self.nbytes += entry.nbytes
        while len(self._d) > self.max_entries or self.nbytes > self.max_bytes:
            _, (_, old) = self._d.popitem(last=False)
            self.nbytes -= old.nbytes

    def get(self, key: _Key) -> tuple[bytes, RetainedKV] | None:
        hit = self._d.get(key)
        if hit is not None:
            self._d.move_to_end(key)
        return hit

    def drop_pod(self, pod: PodId) -> None:
        for key in [k for k, (_, e) in self._d.items() if e.decode_pod == pod]:
            self.pop(key)

    def pop(self, key: _Key, version: bytes | None = None) -> tuple[bytes, RetainedKV] | None:
        """Drop the copy of ``key`` (only if it has ``version``, when given)."""
        hit = self._d.get(key)
        if hit is None or (version is not None and hit[0] != version):
            return None
        del self._d[key]
        self.nbytes -= hit[1].nbytes
        return hit


class RedisStore:
    name = "redis"

    def __init__(self, url: str, *, namespace: str, ttl_s: float, block_size: int,
                 timeout_s: float = 0.5, retry_s: float = 1.0,
                 on_call: Callable[[str, float | None], None] = lambda _op, _s: None,
                 on_evict: Callable[[RetainedKV], None] = lambda _e: None,
                 cache_entries: int = 100_000, cache_bytes: int = 256 << 20) -> None:
        """``on_evict(entry)`` hears each entry whose write after the answer failed;
        ``cache_*`` cap the local copies (module docstring)."""
        self.url = url
        self.ns = namespace
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.block_size = block_size
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.on_call = on_call
        self.on_evict = on_evict
        self.conn = RedisConn(url, timeout_s, scripts=(_TAKE, _PUT, _FIND, _DISCARD))
        self.recent = _Recent(cache_entries, cache_bytes)
        self._ok = True
        self._error: str | None = None
        self._skip_until = 0.0
        self._ver_base = os.urandom(6).hex().encode()
        self._ver_seq = itertools.count()
        self._writes: set[asyncio.Task[bool]] = set()
        # Writes not yet on the socket (the connection was down when they were made): a
        # lookup of their key waits for them, so this process reads its own writes.
        self._unsent: dict[_Key, asyncio.Task[bool]] = {}

    # ---- health ------------------------------------------------------------
    @property
    def ok(self) -> bool:
        return self._ok

    @property
    def error(self) -> str | None:
        return self._error

    def may_hold(self) -> bool:
        return True  # other replicas write too: only a lookup can tell

    def _skipping(self, op: str) -> bool:
        if time.monotonic() < self._skip_until:
            self.on_call(op, None)
            return True
        return False

    def _failed(self, op: str, e: BaseException) -> None:
        self._skip_until = time.monotonic() + self.retry_s
        self.on_call(op, None)
        if self._ok:
            log.warning("conversation store %s unavailable (%s: %s): serving without "
                        "reuse", self.url, type(e).__name__, e)
        self._ok, self._error = False, f"{type(e).__name__}: {e}"

    def _answered(self, op: str, t0: float) -> None:
        self.on_call(op, time.perf_counter() - t0)
        if not self._ok:
            log.warning("conversation store %s is back", self.url)
            self._ok, self._error = True, None

    async def _call(self, op: str, fn: Callable[[], Awaitable[T]], default: T) -> T:
        """Run one Redis call; on any failure answer ``default`` and mark the store down."""
        if self._skipping(op):
            return default
        t0 = time.perf_counter()
        try:
            out = await fn()
        except (ReplyError, OSError, TimeoutError) as e:
            self._failed(op, e)
            return default
        self._answered(op, t0)
        return out

    async def ping(self) -> bool:
        async def go() -> bool:
            return bool(await self.conn.call("PING"))
        return await self._call("ping", go, False)

    # ---- keys --------------------------------------------------------------
    def _member(self, tenant: str, conv: str) -> str:
        return f"{tenant}:{conv}"

    def _entry_key(self, member: str) -> str:
        return f"{self.ns}:ev:{member}"

    def _index_key(self, tenant: str, h: bytes) -> str:
        return f"{self.ns}:i:{tenant}:{h.hex()}"

    # ---- puts --------------------------------------------------------------
    def _put_call(self, entry: RetainedKV) -> tuple[bytes, list[str], list[bytes | str | int]]:
        """The version, keys and args of ``entry``'s put script."""
        ttl = max(1, int((entry.expires_at - time.monotonic()) * 1000))
        ttl = min(ttl, self.ttl_ms)
        member = self._member(entry.tenant, entry.conversation)
        version = self._ver_base + b"%08x" % (next(self._ver_seq) & 0xFFFFFFFF)
        hashes = block_hashes(_ids(entry.covered), self.block_size)
        keys = [self._entry_key(member), f"{self.ns}:m:{member}", f"{self.ns}:all",
                f"{self.ns}:p:{entry.decode_pod}",
                *(self._index_key(entry.tenant, h) for h in hashes)]
        args: list[bytes | str | int] = [version + _encode(entry), ttl, ttl + self.ttl_ms,
                                         member, int(time.time() * 1000), entry.conversation,
                                         2 * self.ttl_ms, _INDEX_KEEP]
        return version, keys, args

    async def aput(self, entry: RetainedKV) -> bool:
        if entry.expires_at - time.monotonic() <= 0.002:
            return False
        version, keys, args = self._put_call(entry)

        async def go() -> bool:
            await self.conn.run_script(_PUT, keys, args)
            return True
        if not await self._call("put", go, False):
            return False
        self.recent.put((entry.tenant, entry.conversation), version, entry)
        return True

    def put_soon(self, entry: RetainedKV) -> bool:
        """Store ``entry`` without waiting for Redis (module docstring): False when it is
        refused at once (already expired, Redis known down); else True, the write under way."""
        if entry.expires_at - time.monotonic() <= 0.002 or self._skipping("put"):
            return False
        version, keys, args = self._put_call(entry)
        key = (entry.tenant, str(entry.conversation))
        self.recent.put(key, version, entry)
        sent = self.conn.send_script(_PUT, keys, args)  # on the socket now, if connected
        task = asyncio.get_running_loop().create_task(
            self._write(entry, key, version, keys, args, sent))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        if sent is None:
            self._unsent[key] = task
            task.add_done_callback(lambda t: self._unsent.pop(key, None)
                                   if self._unsent.get(key) is t else None)
        return True

    async def _write(self, entry: RetainedKV, key: _Key, version: bytes, keys: list[str],
                     args: list[bytes | str | int], sent: asyncio.Future[Any] | None) -> bool:
        t0 = time.perf_counter()
        try:
            await self.conn.run_script(_PUT, keys, args, sent)
        except (ReplyError, OSError, TimeoutError) as e:
            self._failed("put", e)
            self.recent.pop(key, version)
            log.warning("conversation store write of %s lost (%s: %s): its turn is not kept",
                        entry.conversation, type(e).__name__, e)
            self.on_evict(entry)
            return False
        self._answered("put", t0)
        return True

    async def _own_writes(self, key: _Key | None) -> None:
        """Wait for this process's writes not yet sent (of ``key``; None: any)."""
        if not self._unsent:
            return
        pending = list(self._unsent.values()) if key is None else \
            [t for t in (self._unsent.get(key),) if t is not None]
        if pending:
            await asyncio.wait(pending)

    # ---- lookups -----------------------------------------------------------
    async def atake(self, tenant: str,
                    conversation: ConversationId) -> tuple[RetainedKV | None, bool]:
        key = (tenant, str(conversation))
        await self._own_writes(key)
        member = self._member(tenant, conversation)
        keys = [self._entry_key(member), f"{self.ns}:m:{member}", f"{self.ns}:all"]
        copy = self.recent.pop(key)
        args: list[bytes | str | int] = [member, copy[0] if copy is not None else b""]

        async def go() -> Any:
            return await self.conn.run_script(_TAKE, keys, args)
        out = await self._call("take", go, None)
        if not out:
            return None, False
        if out[0] == 2:
            return None, True
        if out[0] == 3 and copy is not None:
            return replace(copy[1], expires_at=_expiry(out[1])), False
        if out[0] != 1:
            return None, False
        return _decode(out[1][_VER_LEN:], conversation, tenant, _expiry(out[2])), False

    async def afind(self, tenant: str, prompt_ids: Sequence[int]) -> ConversationId | None:
        hashes = block_hashes(prompt_ids, self.block_size)
        if not hashes:
            return None
        await self._own_writes(None)
        keys = [self._index_key(tenant, h) for h in reversed(hashes)]

        async def go() -> Any:
            return await self.conn.run_script(_FIND, keys,
                                              [f"{self.ns}:ev:{tenant}:", _CANDIDATES])
        out = await self._call("find", go, None)
        if not out:
            return None
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        for j in range(0, len(out), 4):
            conv = ConversationId(_text(out[j + 1]))
            raw: bytes = out[j + 2]
            version = raw[:_VER_LEN]
            key = (tenant, str(conv))
            copy = self.recent.get(key)
            if copy is not None and copy[0] == version:
                entry = copy[1]
            else:  # read through: the take that follows sends this version back
                entry = _decode(raw[_VER_LEN:], conv, tenant, _expiry(out[j + 3]))
                self.recent.put(key, version, entry)
            n = entry.prompt_len
            if n > len(prompt):
                continue
            # The whole prompt, not only past the block that matched: a digest's list may
            # still name a conversation whose newer turn was stored over the one it was for.
            if np.array_equal(prompt[:n], entry.covered[:n]):
                return conv
        return None

    async def adiscard_pod(self, pod: PodId) -> int:
        async def go() -> int:
            return int(await self.conn.run_script(
                _DISCARD, [f"{self.ns}:p:{pod}", f"{self.ns}:all"], [self.ns]))
        n = await self._call("discard", go, 0)
        self.recent.drop_pod(pod)
        return n

    async def astats(self) -> StoreStats:
        all_key = f"{self.ns}:all"

        async def go() -> int:
            # Both on the socket before either reply: one round trip.
            trim = self.conn.call("ZREMRANGEBYSCORE", all_key, "-inf", int(time.time() * 1000))
            count = self.conn.call("ZCARD", all_key)
            return int((await asyncio.gather(trim, count))[1])
        return StoreStats(self.name, await self._call("stats", go, 0), None)

    async def aclose(self) -> None:
        """Wait for the writes under way (at most ``timeout_s`` more), then disconnect."""
        if self._writes:
            await asyncio.wait(list(self._writes), timeout=self.timeout_s + 0.1)
        await self.conn.aclose()


def _expiry(pttl: Any) -> float:
    return time.monotonic() + max(0, int(pttl)) / 1000


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
