"""Peer fetch: a consumer pulls prefix blocks from another instance's host tier.

Side channel: ZMQ REQ/REP, msgspec messages (``kvtier.wire.peer``). NIXL moves the bytes.

    consumer                          source (PeerServer)
    Hello(identity)          ->       compare model/block size/hash seed/layout
                             <-       Welcome(agent metadata, pool base) | Refused(reason)
    Hold(keys)               ->       n = READY prefix; pin keys[:n] (lease)
                             <-       Held(lease, slots)
    NIXL READ remote slots -> local slots (prepare_store / complete_store locally)
    Release(lease, ok)       ->       unpin (bytes counted as peer_out)
                             <-       Ack (read before the next request, not waited for)

Anything that goes wrong (refused handshake, unreachable or dead source,
keys evicted before the pin, transfer error) makes ``PeerClient.fetch``
return 0 blocks and a reason; the engine recomputes, the reason is counted
in ``TierStats.peer_fallbacks``. A source that pins and then never hears
back frees the pin when the lease expires (``HostTier.expire_leases``).

Threading model: ``PeerServer`` runs one daemon thread owning its REP
socket; every tier call it makes holds the lock shared with the tier's other
user (the connector's scheduler half). ``PeerClient`` is used by one thread
(the scheduler), which holds that same lock around local tier calls; its
REQ sockets (one per peer, reused) never leave that thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import zmq

from kvtier.ids import RequestKey
from kvtier.tier.manager import BlockMeta, HostTier
from kvtier.tier.nixl import NixlPool, TransferError
from kvtier.wire.peer import (
    Ack,
    Held,
    Hello,
    Hold,
    Identity,
    Refused,
    Release,
    Reply,
    Request,
    Welcome,
    decode_reply,
    decode_request,
    encode,
)

log = logging.getLogger(__name__)


# How long after a peer's last request the server keeps driving NIXL progress (one cheap
# call per millisecond): covers the UCX wire-up after Hello and the READ between Hold and
# Release. Longer than any sane reader timeout (peer_timeout_s, default 5 s), which bounds
# a READ on the reader's side.
ACTIVE_WINDOW_S = 30.0


class PeerServer:
    """Serves this instance's host tier to peers on ``tcp://host:port``."""

    def __init__(self, tier: HostTier, lock: threading.RLock, nixl: NixlPool,
                 identity: Identity, host: str, port: int):
        self.tier, self.lock, self.nixl, self.identity = tier, lock, nixl, identity
        self.endpoint = f"tcp://{host}:{port}"
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="kvtier-peer-server", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    def handle(self, req: Request) -> Reply:
        if isinstance(req, Hello):
            why = self.identity.mismatch(req.identity)
            if why is not None:
                return Refused(why)
            return Welcome(self.nixl.metadata(), self.nixl.pool.base_address)
        if isinstance(req, Hold):
            keys = [RequestKey(k) for k in req.keys]
            with self.lock:
                n = self.tier.lookup_prefix(keys)
                job = self.tier.prepare_load(keys[:n]) if n else None
            if job is None:
                return Held(0, [])
            return Held(job.job_id, list(job.slots))
        if isinstance(req, Release):
            with self.lock:
                self.tier.complete_load(req.lease, req.success, path="peer_out")
            return Ack()
        raise TypeError(type(req))

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        try:
            sock = ctx.socket(zmq.REP)
            sock.bind(self.endpoint)
        except Exception as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        active_until = 0.0  # a peer may be mid-handshake or mid-READ until then
        try:
            while not self._stop.is_set():
                busy = time.monotonic() < active_until
                if busy:
                    # No NIXL progress thread (kvtier.tier.nixl): the source side of a
                    # READ must progress its UCX worker itself while a peer reads from it.
                    self.nixl.progress()
                if not sock.poll(1 if busy else 100):
                    continue
                raw = sock.recv()
                active_until = time.monotonic() + ACTIVE_WINDOW_S
                try:
                    reply: Reply = self.handle(decode_request(raw))
                except Exception as e:  # a bad message must not kill the server
                    log.warning("peer server: bad request: %s", e)
                    reply = Refused(f"bad request: {e}")
                sock.send(encode(reply))
        finally:
            sock.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@dataclass(frozen=True)
class FetchResult:
    blocks: int  # leading keys now READY in the local tier (fetched or already there)
    fetched: int  # blocks moved over NIXL
    reason: str | None = None  # why fewer than asked, if any


@dataclass
class _Clock:
    """``with clock(phase):`` adds the block's wall time to ``seconds[phase]``."""

    seconds: dict[str, float]

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


@dataclass
class PeerClient:
    tier: HostTier
    lock: threading.RLock
    nixl: NixlPool
    identity: Identity
    timeout_s: float = 5.0
    _peers: dict[str, tuple[str, int]] = field(default_factory=dict)  # endpoint -> agent, base
    _socks: dict[str, zmq.Socket] = field(default_factory=dict)  # endpoint -> REQ socket
    _unacked: set[str] = field(default_factory=set)  # endpoints owing the Ack of a Release

    def _socket(self, endpoint: str) -> zmq.Socket:
        # One REQ socket per peer, kept across calls (a fetch makes two calls;
        # a fresh TCP connection each time cost more than the lookup itself).
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._socks[endpoint] = sock
        return sock

    def _drop(self, endpoint: str) -> None:
        # A REQ socket that timed out is stuck mid-exchange: drop it.
        self._unacked.discard(endpoint)
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            sock.close()

    def _call(self, endpoint: str, msg: Request) -> Reply:
        sock = self._socket(endpoint)
        ok = False
        try:
            if endpoint in self._unacked:
                # A REQ socket sends only after the last reply is read: read the Ack of the
                # Release sent at the end of the last fetch (long since there if the peer
                # lives; if it does not, this call would time out anyway).
                if not sock.poll(int(self.timeout_s * 1000)):
                    raise TimeoutError(f"peer {endpoint} did not ack in {self.timeout_s}s")
                sock.recv()
                self._unacked.discard(endpoint)
            sock.send(encode(msg))
            if not sock.poll(int(self.timeout_s * 1000)):
                raise TimeoutError(f"peer {endpoint} did not answer in {self.timeout_s}s")
            reply = decode_reply(sock.recv())
            ok = True
            return reply
        finally:
            if not ok:
                self._drop(endpoint)

    def _release(self, endpoint: str, msg: Release) -> None:
        """Send ``msg`` without waiting for its Ack (read by the next call to this peer).

        The reader needs nothing from the Ack, and the source's ``PeerServer`` shares its
        process, and the GIL, with a busy engine, so a reply can wait for the GIL (up to the
        interpreter's switch interval, 5 ms by default; the ``hold`` phase of a fetch is the
        same kind of round trip): waiting for it would add that to every pulled turn."""
        sock = self._socket(endpoint)
        try:
            sock.send(encode(msg), zmq.NOBLOCK)
            self._unacked.add(endpoint)
        except zmq.ZMQError:
            self._drop(endpoint)  # the source's lease expires on its own

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()
        self._unacked.clear()

    def _fallback(self, reason: str, blocks: int = 0) -> FetchResult:
        with self.lock:
            self.tier.stats.record_fallback(reason.split(":")[0])
        return FetchResult(blocks, 0, reason)

    def fetch(self, host: str, port: int, keys: Sequence[RequestKey],
              metas: Sequence[BlockMeta] | None = None) -> FetchResult:
        """Make ``keys`` (a prefix chain) READY locally, pulling what is missing.

        ``metas`` (token ids, hashes) label the fetched blocks in tier events. The seconds
        each phase took go to ``TierStats.peer_fetch_s`` (``kvtier_tier_peer_fetch_seconds``)."""
        phases: dict[str, float] = {}
        try:
            return self._fetch(host, port, keys, metas, _Clock(phases))
        finally:
            if phases:
                with self.lock:
                    self.tier.stats.record_peer_fetch(phases)

    def _fetch(self, host: str, port: int, keys: Sequence[RequestKey],
               metas: Sequence[BlockMeta] | None, clock: _Clock) -> FetchResult:
        with self.lock:
            local = self.tier.lookup_prefix(keys)
        if local == len(keys):
            return FetchResult(local, 0)
        want = list(keys[local:])
        endpoint = f"tcp://{host}:{port}"
        try:
            peer = self._peers.get(endpoint)
            if peer is None:
                with clock("handshake"):
                    rep = self._call(endpoint, Hello(self.identity))
                    if isinstance(rep, Refused):
                        return self._fallback(f"refused: {rep.reason}", local)
                    assert isinstance(rep, Welcome)
                    peer = (self.nixl.add_peer(rep.agent_metadata), rep.pool_base)
                self._peers[endpoint] = peer
            with clock("hold"):
                held = self._call(endpoint, Hold([int(k) for k in want]))
        except (TimeoutError, zmq.ZMQError) as e:
            self._peers.pop(endpoint, None)
            return self._fallback(f"unreachable: {e}", local)
        assert isinstance(held, Held)
        if not held.slots:
            return self._fallback("evicted: source holds none of the blocks", local)
        n = len(held.slots)
        ok = False
        moved = 0
        with self.lock:
            job = self.tier.prepare_store(
                want[:n], list(metas[local:local + n]) if metas is not None else None)
        try:
            if job is None or not job.keys:
                return self._fallback("local tier full", local)
            # prepare_store may place a prefix only and skips keys that are
            # present: map each placed key back to the source's slot.
            src = {k: held.slots[i] for i, k in enumerate(want[:n])}
            remote = [src[k] for k in job.keys]
            with clock("read"):
                moved = self.nixl.read(peer[0], peer[1], remote, job.slots, self.timeout_s)
            ok = True
        except TransferError as e:
            self._peers.pop(endpoint, None)
            return self._fallback(f"transfer_failed: {e}", local)
        finally:
            if job is not None:
                with self.lock:
                    self.tier.complete_store(job.job_id, ok)
                    if ok:
                        self.tier.stats.record_move("peer_in", moved)
            with clock("release"):
                self._release(endpoint, Release(held.lease, ok))
        with self.lock:
            got = self.tier.lookup_prefix(keys)
        reason = None if got == len(keys) else "evicted: source held a shorter prefix"
        if reason:
            with self.lock:
                self.tier.stats.record_fallback("partial")
        return FetchResult(got, len(job.keys), reason)
