"""Redis backend for the prefix index: shared by indexer replicas, survives restarts.

Layout (``ns`` = namespace, default ``kvtier``; hashes and keys as 16 hex digits):

- ``ns:map:{pod}``  HASH  engine hash -> request key (16 hex) + 1 byte of tier bits
- ``ns:key:{rk}``   SET   holders ``"{pod}|G"`` / ``"{pod}|C"``
- ``ns:lru``        ZSET  request key -> logical clock (LRU order; capacity bound)
- ``ns:clock``, ``ns:evicted``, ``ns:pods`` (SET of stream ids: the holder names)
- ``ns:seq``        HASH  stream id -> last applied event seq (replicas resume from it)
- ``ns:gen``        STRING a random generation id, set once per dataset: when it is gone
  or changed, Redis lost (or was swapped for) the data, and replicas rebuild by replay

Every write and the prefix walk are Lua scripts, so each call is one round
trip and atomic (a 128k-token lookup is one script call, not 4,000
commands). Scripts touch keys they compute from ARGV, so this backend needs
a single Redis/Valkey node, not a cluster.

Threading model: a ``redis.Redis`` client is thread-safe (connection pool);
every call is atomic on the server.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from kvtier.ids import EngineBlockHash, PodId, RequestKey, Tier
from kvtier.indexer.index import (
    TIER_BIT,
    TIERS_BY_BIT,
    BackendUnavailable,
    Holder,
    IndexStats,
    MappingEntry,
)

_TCHAR = {Tier.GPU: "G", Tier.CPU: "C"}
_CHAR_TIER = {"G": Tier.GPU, "C": Tier.CPU}

# Shared Lua: drop holder `pod|tierchar` of key `rk`; delete the key when it has none left.
_UNSET = """
local function unset(ns, rk, member)
  local k = ns .. ':key:' .. rk
  redis.call('SREM', k, member)
  if redis.call('SCARD', k) == 0 then
    redis.call('DEL', k)
    redis.call('ZREM', ns .. ':lru', rk)
  end
end
local function unset_bits(ns, pod, rk, bits)
  if bit.band(bits, 1) ~= 0 then unset(ns, rk, pod .. '|G') end
  if bit.band(bits, 2) ~= 0 then unset(ns, rk, pod .. '|C') end
end
"""

_STORE = _UNSET + """
local ns, pod, tb, maxk = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local member = pod .. (tb == 1 and '|G' or '|C')
local mapk = ns .. ':map:' .. pod
local clock = redis.call('INCR', ns .. ':clock')
redis.call('SADD', ns .. ':pods', pod)
for i = 5, #ARGV, 2 do
  local eh, rk = ARGV[i], ARGV[i + 1]
  local bits = tb
  local old = redis.call('HGET', mapk, eh)
  if old then
    local ork, obits = string.sub(old, 1, 16), string.byte(old, 17)
    if ork == rk then bits = bit.bor(obits, tb) else unset_bits(ns, pod, ork, obits) end
  end
  redis.call('HSET', mapk, eh, rk .. string.char(bits))
  redis.call('SADD', ns .. ':key:' .. rk, member)
  redis.call('ZADD', ns .. ':lru', clock, rk)
end
local n = redis.call('ZCARD', ns .. ':lru')
if n > maxk then
  local victims = redis.call('ZPOPMIN', ns .. ':lru', n - maxk)
  for j = 1, #victims, 2 do redis.call('DEL', ns .. ':key:' .. victims[j]) end
  redis.call('INCRBY', ns .. ':evicted', #victims / 2)
end
return 0
"""

_REMOVE = _UNSET + """
local ns, pod, tb = ARGV[1], ARGV[2], tonumber(ARGV[3])
local mapk = ns .. ':map:' .. pod
local n = 0
for i = 4, #ARGV do
  local eh = ARGV[i]
  local old = redis.call('HGET', mapk, eh)
  if old then
    local rk, bits = string.sub(old, 1, 16), string.byte(old, 17)
    local drop = bit.band(bits, tb)
    if drop ~= 0 then
      n = n + 1
      unset_bits(ns, pod, rk, drop)
      local rest = bit.band(bits, bit.bnot(tb))
      if rest == 0 then redis.call('HDEL', mapk, eh)
      else redis.call('HSET', mapk, eh, rk .. string.char(rest)) end
    end
  end
end
return n
"""

# Longest consecutive prefix per holder. Returns a flat list member, depth, ...
_LOOKUP = """
local ns, touch = ARGV[1], ARGV[2] == '1'
local first = 3
local active, nactive = {}, 0
local out = {}
local depth_max = 0
for i = first, #ARGV do
  local members = redis.call('SMEMBERS', ns .. ':key:' .. ARGV[i])
  if i == first then
    for _, m in ipairs(members) do active[m] = true; nactive = nactive + 1 end
  else
    local here = {}
    for _, m in ipairs(members) do here[m] = true end
    for m in pairs(active) do
      if not here[m] then
        active[m] = nil; nactive = nactive - 1
        out[#out + 1] = m; out[#out + 1] = i - first
        if i - first > depth_max then depth_max = i - first end
      end
    end
  end
  if nactive == 0 then break end
end
for m in pairs(active) do
  out[#out + 1] = m; out[#out + 1] = #ARGV - first + 1
  depth_max = #ARGV - first + 1
end
if touch and depth_max > 0 then
  local clock = redis.call('INCR', ns .. ':clock')
  for i = first, first + depth_max - 1 do
    redis.call('ZADD', ns .. ':lru', 'XX', clock, ARGV[i])
  end
end
return out
"""


_P = ParamSpec("_P")
_R = TypeVar("_R")
# What "Redis cannot be reached" looks like to redis-py (BusyLoadingError: restarted, still
# loading its dump; ReadOnlyError: a replica that was promoted away).
_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.BusyLoadingError,
         redis.exceptions.ReadOnlyError)


def _guarded(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except _DOWN as e:
            self = args[0]
            raise BackendUnavailable(f"redis {getattr(self, 'where', '?')}: {e}") from e
    return wrapper


def _hex(v: int) -> str:
    return f"{v:016x}"


def _text(v: bytes | str) -> str:
    """A reply string. Our client replies bytes (``decode_responses=False``); redis-py's
    types cannot know that, so they say ``bytes | str``."""
    return v.decode() if isinstance(v, bytes) else v


class RedisIndex:
    """``KVIndex`` on one Redis node. ``max_keys`` bounds request keys (LRU)."""

    def __init__(self, client: redis.Redis, namespace: str = "kvtier",
                 max_keys: int = 2_000_000, touch_on_lookup: bool = True) -> None:
        self.r = client
        kw = client.connection_pool.connection_kwargs
        self.where = kw.get("path") or f"{kw.get('host', '?')}:{kw.get('port', '?')}"
        self.ns = namespace
        self.max_keys = max_keys
        self.touch = touch_on_lookup
        self._store = client.register_script(_STORE)
        self._remove = client.register_script(_REMOVE)
        self._lookup = client.register_script(_LOOKUP)

    @classmethod
    def from_url(cls, url: str, timeout_s: float = 2.0, **kw: Any) -> RedisIndex:
        """Bounded timeouts: a Redis that stops answering is reported within ``timeout_s``
        instead of hanging the caller; redis-py reconnects on the next call by itself."""
        # Two quick retries: a pooled connection that died with a Redis restart is
        # replaced without the caller seeing an error; a Redis that is down fails fast.
        retry = Retry(ExponentialBackoff(cap=0.2, base=0.02), retries=2)
        return cls(redis.Redis.from_url(url, decode_responses=False,
                                        socket_connect_timeout=timeout_s,
                                        socket_timeout=timeout_s, retry=retry,
                                        retry_on_error=[redis.ConnectionError,
                                                        redis.TimeoutError]), **kw)

    @_guarded
    def ping(self) -> None:
        self.r.ping()

    @_guarded
    def store(self, pod: PodId, tier: Tier,
              blocks: Sequence[tuple[EngineBlockHash, RequestKey]]) -> None:
        if not blocks:
            return
        args: list[str | int] = [self.ns, pod, TIER_BIT[tier], self.max_keys]
        for eh, rk in blocks:
            args += (_hex(eh), _hex(rk))
        self._store(args=args)

    @_guarded
    def resolve(self, pod: PodId, engine_hash: EngineBlockHash) -> RequestKey | None:
        v = self.r.hget(f"{self.ns}:map:{pod}", _hex(engine_hash))
        return None if v is None else RequestKey(int(v[:16], 16))

    @_guarded
    def remove(self, pod: PodId, tier: Tier, hashes: Sequence[EngineBlockHash]) -> int:
        if not hashes:
            return 0
        return int(self._remove(args=[self.ns, pod, TIER_BIT[tier], *map(_hex, hashes)]))

    @_guarded
    def clear_pod(self, pod: PodId) -> int:
        mapk = f"{self.ns}:map:{pod}"
        n = 0
        hashes = [eh.decode() for eh, _ in self.r.hscan_iter(mapk, count=1000)]
        # Chunked, so a pod with a million blocks does not block Redis in one script.
        for i in range(0, len(hashes), 1000):
            n += int(self._remove(args=[self.ns, pod, 3, *hashes[i:i + 1000]]))
        self.r.delete(mapk)
        self.r.srem(f"{self.ns}:pods", pod)
        self.r.hdel(f"{self.ns}:seq", pod)
        return n

    @_guarded
    def lookup(self, keys: Sequence[RequestKey]) -> dict[Holder, int]:
        if not keys:
            return {}
        flat = self._lookup(args=[self.ns, "1" if self.touch else "0", *map(_hex, keys)])
        out: dict[Holder, int] = {}
        for i in range(0, len(flat), 2):
            pod, _, t = flat[i].decode().rpartition("|")
            out[(PodId(pod), _CHAR_TIER[t])] = int(flat[i + 1])
        return out

    @_guarded
    def pod_entries(self, pod: PodId) -> list[MappingEntry]:
        out: list[MappingEntry] = []
        for eh, v in self.r.hscan_iter(f"{self.ns}:map:{pod}", count=1000):
            bits = v[16]
            out.append(MappingEntry(EngineBlockHash(int(eh, 16)), RequestKey(int(v[:16], 16)),
                                    frozenset(t for tb, t in TIERS_BY_BIT if bits & tb)))
        return out

    @_guarded
    def pods(self) -> list[PodId]:
        return [PodId(_text(p)) for p in self.r.smembers(f"{self.ns}:pods")]

    @_guarded
    def stats(self) -> IndexStats:
        pipe = self.r.pipeline(transaction=False)
        pipe.zcard(f"{self.ns}:lru")
        pipe.get(f"{self.ns}:evicted")
        pipe.smembers(f"{self.ns}:pods")
        keys, evicted, pods = pipe.execute()
        pipe = self.r.pipeline(transaction=False)
        for p in pods:
            pipe.hlen(f"{self.ns}:map:{p.decode()}")
        mappings = sum(pipe.execute()) if pods else 0
        return IndexStats(keys=int(keys), mappings=int(mappings), evicted=int(evicted or 0))

    # -- shared by replicas (``kvtier.indexer.replicas``) ------------------------------------

    @_guarded
    def generation(self, claim: str | None = None) -> str | None:
        """The dataset's generation id; with ``claim``, set it first unless one is set."""
        if claim is not None:
            self.r.set(f"{self.ns}:gen", claim, nx=True)
        v = self.r.get(f"{self.ns}:gen")
        return None if v is None else _text(v)

    @_guarded
    def save_seqs(self, seqs: dict[PodId, int]) -> None:
        if seqs:
            self.r.hset(f"{self.ns}:seq", mapping={k: str(v) for k, v in seqs.items()})

    @_guarded
    def load_seqs(self) -> dict[PodId, int]:
        return {PodId(_text(k)): int(v) for k, v in self.r.hgetall(f"{self.ns}:seq").items()}

    def close(self) -> None:
        self.r.close()
