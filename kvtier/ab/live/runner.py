"""The live A/B runner: replay one trace through each strategy's real stack.

For every strategy: start its stack (``LocalStack``, ≤ 3 instances, one at a
time under the machine-wide lock, ``kvtier.ab.live.lock``), the indexer
in-process when the strategy uses it, and the router (``RouterServer``); replay
the trace (conversation starts and tool waits multiplied by ``time_scale``,
every conversation on its own thread, so the trace's own overlap is the
concurrency); record each turn and sample memory; stop everything
(``try/finally``).

How each number is measured (also written into the report, ``MEASUREMENT``):

- The runner talks to the router like ``kvtier.router.client.Conversation``
  (token-id history, non-streaming completions, ``ignore_eos`` so a turn
  generates exactly the trace's ``response_tokens``) and tags every turn with
  an ``x-request-id``, which the router forwards on both legs. What the
  router's answer cannot say comes from a ``LegTap``, the router's transport,
  which times every upstream completion leg and keeps each engine answer's
  ``kv_transfer_params``, keyed by that id.
- ``reuse_path``, ``reused_tokens``, ``outcome``: the router's own decision,
  from its answer's ``x-kvtier-reuse: PATH; tokens=N`` and
  ``x-kvtier-outcome`` headers (``kvtier.ab.live.headers``); a failed turn
  records ``none``/0/``none``. ``computed_tokens`` = prompt - reused.
- ``ttft_s`` (leg tap): client send -> the router's prefill leg answered (the first token
  exists on P; router overhead, indexer calls, D->P/peer reads and the prompt's
  prefill are inside). The P->D KV move and decode are in ``e2e_s`` only. When
  the router fell back to one instance (no P/D), ttft = e2e.
- ``transfer_s``: the prefill instances' ``vllm:nixl_xfer_time_seconds_sum``
  over the strategy's run, split over reusing turns by transferred tokens (vLLM
  exports no per-request transfer time; peer reads of the host tier are not in
  this metric).
- ``device_blocks_retained`` (leg tap): a ledger of what decode nodes pin: after each
  turn D returns ``remote_num_tokens`` it keeps for ``decoder_kv_blocks_ttl``
  (the decode leg's ``kv_transfer_params``, which the router never shows its
  client); the blocks are freed when a prefill reads them (a ``dp_read`` turn)
  or at D's TTL. The engines' ``vllm:kv_cache_usage_perc`` is sampled too
  (``meta``).
  When the decode nodes export their own retention metrics (``KVTierNixlConnector`` with
  decode leases, ``kvtier.ab.live.probes.DecodeRetention``) the samples are their
  ``kvtier_decode_blocks_retained`` and block-seconds their own counter
  (``meta["device_blocks_source"]`` says which one a run used).
- ``host_bytes_held``: host-tier blocks per the tier's KV events (indexer
  counters: stored - removed, medium CPU) x block bytes from the model config.
- ``meta["engine"]``: the engines' own queue time, inter-token latency, preemptions and
  running/waiting peaks (``kvtier.ab.live.probes.EngineProbe``); ``refusal``: the router's
  ``served`` log line for the turn (``kvtier.ab.live.probes.ServedLog``).
- Decode leases (a strategy whose config has them, ``tiered-adaptive``): the router gets each
  decode node's ``lease`` endpoint (``router_instances``) and the strategy's retention
  settings (``StrategySpec.router_settings``: ``retention: adaptive`` with the cost model);
  each turn's ``hold_s`` / ``hold_basis`` / ``hold_samples`` come from the router's ``served``
  line and ``hold_why`` from its ``hold`` line.

Threading model: ``run_strategy`` is called from one thread; it owns one
thread per conversation, a sampler thread, and the router/indexer server
threads, and joins or stops all of them before it returns.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import Field

from kvtier.ab.live.lock import e2e_lock
from kvtier.ab.live.probes import (
    DecodeRetention,
    EngineProbe,
    Endpoint,
    ServedLog,
    capture_served,
    lease_endpoint,
    lease_metrics_urls,
)
from kvtier.ab.live.scrape import metric, scrape
from kvtier.ab.records import MemorySample, RunResult, TurnRecord
from kvtier.ab.strategies import StrategySpec
from kvtier.ab.traces import ConversationSpec, Trace, token_ids
from kvtier.devstack.spec import InstanceSpec, StackSpec
from kvtier.devstack.stack import LocalStack
from kvtier.ids import Outcome, ReusePath
from kvtier.router.config import RouterConfig
from kvtier.router.server import RouterServer
from kvtier.runtime import ServerThread
from kvtier.wire.reuse_headers import ReuseReport, parse_reuse_headers

if TYPE_CHECKING:
    from tqdm import tqdm

    from kvtier.indexer.service import IndexerService

log = logging.getLogger("kvtier.ab")

MEASUREMENT = {
    "ttft_s": "client send -> router's prefill leg answered (first token computed on P; includes "
              "router, indexer, D->P/peer reads, prefill). P->D move and decode only in e2e_s",
    "e2e_s": "client send -> full non-streaming answer from the router",
    "reused_tokens": "the router's x-kvtier-reuse header (tokens=N: prompt tokens reused); "
                     "computed = prompt - reused",
    "reuse_path": "the router's x-kvtier-reuse header (dp_read, p2p, local, none)",
    "outcome": "the router's x-kvtier-outcome header (full, trimmed, stale, expired, none)",
    "transfer_s": "prefill instances' vllm:nixl_xfer_time_seconds_sum over the run, split over "
                  "reusing turns by transferred tokens (peer host-tier reads not included)",
    "device_blocks_retained": "ledger of decode-pinned KV: D's remote_num_tokens after each turn, "
                              "held until a prefill reads it or D's decoder_kv_blocks_ttl ends; "
                              "never more than the decode engines' blocks in use "
                              "(vllm:kv_cache_usage_perc x num_gpu_blocks) when they say",
    "host_bytes_held": "host-tier blocks (tier KV events, stored - removed, via the indexer) x "
                       "block bytes from the model config",
    "engine_kv_usage": "engines' vllm:kv_cache_usage_perc, sampled with memory (meta)",
    "device_blocks_source": "'decode metrics': the decode nodes' kvtier_decode_blocks_retained "
                            "(samples) and kvtier_decode_block_seconds_held_total (block·s); "
                            "'ledger': the estimate above; 'ledger, capped by decode KV in use': "
                            "some samples were over the decode engines' blocks in use",
    "queue / ITL / preemptions": "engines' vllm:request_queue_time_seconds and "
                                 "vllm:inter_token_latency_seconds histograms and "
                                 "vllm:num_preemptions_total, deltas over the run per role; "
                                 "peaks of vllm:num_requests_running/waiting from the samples; "
                                 "p90s are interpolated inside histogram buckets, so their "
                                 "resolution is vLLM's bucket width (queue: first bound 0.3 s)",
    "turns_per_min": "turns answered / the run's wall time (same offered load for every "
                     "strategy: the trace's start times and waits)",
    "refusal": "the router's served log line: why retained device KV was not read",
    "hold_s / hold_basis": "decode leases: the router's served log line -- how long it chose to "
                           "hold the turn's device KV (0: released at once) and on what basis "
                           "(renew; adaptive: the conversation's own waits, the fleet's, or "
                           "the default before any wait was seen)",
}


# ----------------------------------------------------------------- leg tap -----------
@dataclass
class Leg:
    """One upstream completion leg of a turn, as the router's transport saw it."""

    inst: str
    role: str                 # "prefill" | "decode" | "direct"
    t0: float
    t1: float                 # perf_counter when the engine's answer was read in full
    ok: bool                  # 200 with a JSON body
    kv_out: dict | None       # the answer's kv_transfer_params
    # usage.prompt_tokens_details.cached_tokens: the prompt tokens the engine did not compute
    # (prefix cache or loaded KV), as vLLM counted them; None when it did not say
    cached_tokens: int | None = None


class LegTap(httpx.AsyncBaseTransport):
    """Router transport that forwards everything and records completion legs by request id.

    Only what the router's reuse headers cannot tell: when the prefill leg answered (TTFT), how
    many prompt tokens the engine actually did not compute (its ``cached_tokens``: the router's
    header says what it planned, a failed or partial load makes the engine compute more) and
    what the decode node kept (the decode answer's ``kv_transfer_params``, which the router
    strips from its own answer)."""

    def __init__(self, roles: Mapping[str, tuple[str, str]]) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.roles = roles  # url -> (instance name, role)
        self.legs: dict[str, list[Leg]] = {}
        self._lock = threading.Lock()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        rid = request.headers.get("x-request-id")
        if rid is None or request.method != "POST" or not request.url.path.endswith("completions"):
            return await self.inner.handle_async_request(request)
        body = json.loads(await request.aread() or b"{}")
        t0 = time.perf_counter()
        resp = await self.inner.handle_async_request(request)
        raw = await resp.aread()
        t1 = time.perf_counter()
        try:
            out = json.loads(raw) if resp.status_code == 200 else None
        except ValueError:
            out = None
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        name, _ = self.roles.get(base, (base, "?"))
        # The leg's role from what the router asked for, not the instance's configured role:
        # a direct fallback may land on a prefill instance.
        kvp: dict[str, Any] | None = body.get("kv_transfer_params")
        if kvp is None:
            role = "direct"
        else:
            role = "prefill" if kvp.get("do_remote_decode") else "decode"
        ok = isinstance(out, dict)
        kv_out = out.get("kv_transfer_params") if isinstance(out, dict) else None
        leg = Leg(name, role, t0, t1, ok, kv_out if isinstance(kv_out, dict) else None,
                  _cached_tokens(out))
        with self._lock:
            self.legs.setdefault(rid, []).append(leg)
        headers = [(k, v) for k, v in resp.headers.raw
                   if k.lower() not in (b"content-length", b"transfer-encoding")]
        return httpx.Response(resp.status_code, headers=headers, content=raw,
                              extensions=resp.extensions)

    def take(self, rid: str) -> list[Leg]:
        with self._lock:
            return self.legs.pop(rid, [])

    async def aclose(self) -> None:
        await self.inner.aclose()


# ----------------------------------------------------------------- device ledger -----
class DeviceLedger:
    """What decode nodes pin between turns (see the module docstring)."""

    def __init__(self, block_size: int, ttl_s: float | None) -> None:
        self.bs, self.ttl = block_size, ttl_s
        # conversation -> [(blocks, freed_at)]: D pins each turn's KV until read or TTL
        self._held: dict[str, list[tuple[int, float]]] = {}
        self._lock = threading.Lock()

    def retained(self, conv: str, tokens: int, now: float) -> None:
        if self.ttl:
            with self._lock:
                self._held.setdefault(conv, []).append((math.ceil(tokens / self.bs),
                                                        now + self.ttl))

    def read(self, conv: str) -> None:
        """A prefill read the latest retained KV: D frees it."""
        with self._lock:
            held = self._held.get(conv)
            if held:
                held.pop()

    def blocks(self, now: float) -> int:
        with self._lock:
            return sum(b for h in self._held.values() for b, until in h if until > now)


# ----------------------------------------------------------------- helpers -----------
@contextlib.contextmanager
def indexer_for(stack: LocalStack, model_name: str,
                block_size: int) -> Iterator[tuple[IndexerService, str]]:
    """In-process indexer subscribed to every instance's host-tier events, served over HTTP."""
    from kvtier.indexer.config import IndexerConfig, PodSpec
    from kvtier.indexer.http import build_app
    from kvtier.indexer.service import IndexerService

    pods = [PodSpec(name=i.spec.name, events=f"tcp://127.0.0.1:{i.spec.tier_events_port}",
                    replay=f"tcp://127.0.0.1:{i.spec.tier_replay_port}",
                    p2p=f"127.0.0.1:{i.spec.tier_p2p_port}") for i in stack.instances]
    cfg = IndexerConfig(port=0, pods=tuple(pods), default_model=model_name,
                        block_size=block_size)
    svc = IndexerService(cfg)
    svc.start()
    # Replay the trace only once every tier's event PUB is connected, or the first turn's
    # blocks go missing from the host-bytes ledger (seen: host-p2p e2e reporting 0 bytes).
    if not svc.wait_connected(15.0):
        log.warning("host bytes held may be undercounted")
    try:
        with ServerThread(build_app(svc), name="kvtier-ab-idx") as srv:
            yield svc, srv.url
    finally:
        svc.stop()


@contextlib.contextmanager
def locked_stack(spec: StackSpec, log_dir: Path) -> Iterator[LocalStack]:
    """A LocalStack under the machine-wide e2e lock (one stack at a time on this machine)."""
    with e2e_lock(), LocalStack(spec, log_dir) as stack:
        yield stack


StackProvider = Callable[[StackSpec, Path], contextlib.AbstractContextManager[LocalStack]]


# ----------------------------------------------------------------- the run -----------
@dataclass
class RunOptions:
    model: str                    # model directory
    time_scale: float = 1.0
    sample_interval_s: float = 0.5
    block_size: int = 32
    max_model_len: int = 4096     # the stack's --max-model-len
    kv_bytes_per_token: int = 0   # host bytes = blocks x block_size x this
    log_dir: Path = field(default_factory=lambda: Path("ab-logs"))
    progress: bool = True
    turn_timeout_s: float = 600.0
    # One conversation after another, start times ignored (calibration: no prefill overlaps,
    # so every TTFT is a clean sample of one request's cost).
    sequential: bool = False
    # A regime's stack settings (kvtier.ab.regimes): vLLM arguments for every instance and
    # per role ("prefill"/"decode"), environment per role.
    extra_args: tuple[str, ...] = ()
    role_args: dict[str, tuple[str, ...]] = field(default_factory=dict)
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)


class RoleStackSpec(StackSpec):
    """A ``StackSpec`` whose instances of one role get extra vLLM arguments and environment
    (a regime's scarce decode KV: ``--num-gpu-blocks-override`` on decode nodes only)."""

    role_args: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    role_env: dict[str, dict[str, str]] = Field(default_factory=dict)

    def instances(self) -> list[InstanceSpec]:
        out = []
        for i in super().instances():
            r = i.role.value
            out.append(i.model_copy(update={
                "extra_args": (*i.extra_args, *self.role_args.get(r, ())),
                "extra_env": {**i.extra_env, **self.role_env.get(r, {})}}))
        return out


def stack_spec_for(strategy: StrategySpec, model: str, **kw: Any) -> StackSpec:
    """The local stack that deploys ``strategy``: its topology and ``--kv-transfer-config``
    (and a regime's per-role settings, ``role_args`` / ``role_env``, when given)."""
    extra = tuple(kw.pop("extra_args", ()))
    role_args, role_env = kw.pop("role_args", None), kw.pop("role_env", None)
    if not strategy.prefix_caching:
        # StackSpec always passes --enable-prefix-caching (KV events need it);
        # argparse keeps the last of the pair.
        extra = (*extra, "--no-enable-prefix-caching")
    # Usage then reports cached_tokens per request: the prefill's reused tokens.
    extra = (*extra, "--enable-prompt-tokens-details")
    if role_args or role_env:
        return RoleStackSpec(model=model, prefill=strategy.prefill, decode=strategy.decode,
                             kv_transfer_config=strategy.kv_transfer_config(), extra_args=extra,
                             role_args=role_args or {}, role_env=role_env or {}, **kw)
    return StackSpec(model=model, prefill=strategy.prefill, decode=strategy.decode,
                     kv_transfer_config=strategy.kv_transfer_config(), extra_args=extra, **kw)


def run_strategy(spec: StrategySpec, trace: Trace, opts: RunOptions,
                 stack_provider: StackProvider = locked_stack,
                 stack: LocalStack | None = None) -> RunResult:
    """Run ``trace`` through ``spec``'s stack. ``stack``: an already running one (tests)."""
    spec = spec.scaled(opts.time_scale)
    sspec = stack_spec_for(spec, opts.model, block_size=opts.block_size,
                           max_model_len=opts.max_model_len, extra_args=opts.extra_args,
                           role_args=opts.role_args, role_env=opts.role_env)
    if stack is not None:
        return _run_on(spec, trace, opts, stack)
    with stack_provider(sspec, opts.log_dir / spec.name) as st:
        return _run_on(spec, trace, opts, st)


def _run_on(spec: StrategySpec, trace: Trace, opts: RunOptions, stack: LocalStack) -> RunResult:
    model_name = Path(opts.model).name
    with contextlib.ExitStack() as es:
        idx_svc, idx_url = (es.enter_context(indexer_for(stack, model_name, opts.block_size))
                            if spec.use_indexer else (None, None))
        roles = {i.url: (i.spec.name, i.spec.role.value) for i in stack.instances}
        tap = LegTap(roles)
        rcfg = RouterConfig.model_validate({
            "instances": router_instances(stack),
            "indexer": idx_url, "indexer_model": model_name if idx_url else None,
            "port": 0, "log_json": False, "block_size": opts.block_size,
            # A slow prefill is the measurement, not a fault: no leg times out
            # before the turn itself would.
            "timeouts": {"prefill_s": opts.turn_timeout_s, "decode_idle_s": opts.turn_timeout_s},
            **spec.router_settings()})
        served = es.enter_context(capture_served())
        srv = es.enter_context(RouterServer(rcfg, transport=tap))
        http = es.enter_context(httpx.Client(timeout=30))
        return _replay(spec, trace, opts, stack, srv.url, tap, idx_svc, http, model_name,
                       served)


def router_instances(stack: LocalStack) -> list[dict[str, Any]]:
    """The router's ``instances``: name, URL and role of each, and a decode node's ``lease``
    endpoint when the stack's ``--kv-transfer-config`` has decode leases (side-channel port +
    ``lease_port_offset``, ``kvtier.ab.live.probes.lease_endpoint``)."""
    kv = stack.spec.kv_transfer_config
    out: list[dict[str, Any]] = []
    for i in stack.instances:
        inst: dict[str, Any] = {"name": i.spec.name, "url": i.url, "role": i.spec.role.value}
        if i.spec.role.value == "decode":
            lease = lease_endpoint(i.spec.side_channel_port, kv)
            if lease is not None:
                inst["lease"] = lease
        out.append(inst)
    return out


def _replay(spec: StrategySpec, trace: Trace, opts: RunOptions, stack: LocalStack, url: str,
            tap: LegTap, idx_svc: IndexerService | None, http: httpx.Client,
            model_name: str, served: ServedLog | None = None) -> RunResult:
    ledger = DeviceLedger(opts.block_size, spec.decode_ttl_s if spec.device_retention else None)
    records: list[TurnRecord] = []
    memory: list[MemorySample] = []
    usage: list[dict[str, float]] = []
    probe = EngineProbe([Endpoint(i.spec.name, i.spec.role.value, i.url)
                         for i in stack.instances])
    own = DecodeRetention(lease_metrics_urls([i.spec.side_channel_port for i in stack.decode],
                                             stack.spec.kv_transfer_config))
    probe.start(http)
    own.start(http)
    rec_lock = threading.Lock()
    stop = threading.Event()
    prefill_urls = [i.url for i in stack.prefill]
    xfer0 = sum(scrape(http, u, "vllm:nixl_xfer_time_seconds_sum") for u in prefill_urls)
    total = sum(len(c.turns) for c in trace.conversations)
    bar = _bar(total, spec.name, opts.progress)
    t_run = time.perf_counter()
    block_bytes = opts.block_size * opts.kv_bytes_per_token

    def host_bytes() -> int:
        if idx_svc is None:
            return 0
        d = idx_svc.pod_details()
        return sum(max(0, p["blocks_stored"] - p["blocks_removed"]) for p in d.values()) \
            * block_bytes

    capped = [0]  # ledger samples over the decode engines' blocks in use

    def sampler() -> None:
        with httpx.Client(timeout=5) as c:
            while True:
                now = time.perf_counter()
                counted = own.sample(c)
                u = probe.sample(c)
                if math.isfinite(counted):
                    blocks = int(counted)
                else:
                    # The ledger assumes D keeps every turn until read or TTL; a full decode
                    # node cannot hold more than it has in use (seen: a decode-scarce run's
                    # ledger averaged 288 retained blocks on a 160-block decode at 92% usage).
                    blocks = ledger.blocks(now)
                    in_use = probe.decode_blocks_in_use(u)
                    if math.isfinite(in_use) and blocks > in_use:
                        blocks = math.ceil(in_use)
                        capped[0] += 1
                memory.append(MemorySample(spec.name, now - t_run, blocks, host_bytes()))
                usage.append({"t": now - t_run, **u})
                if stop.wait(opts.sample_interval_s):
                    return

    def one(conv: ConversationSpec) -> None:
        delay = conv.start_s * opts.time_scale - (time.perf_counter() - t_run)
        if delay > 0 and not opts.sequential:
            time.sleep(delay)
        cid = f"{spec.name}-{conv.conversation_id}-{uuid.uuid4().hex[:6]}"
        history: list[int] = []
        last: tuple[list[int], list[int]] | None = None  # (prompt, generated) of the last turn
        # The router's own request id (its answer's x-request-id) keys the legs the tap saw:
        # a router that forwards the client's id on the legs returns that same id.
        answered: dict[str, str] = {}

        def on_response(resp: httpx.Response) -> None:
            answered["rid"] = resp.headers.get("x-request-id", "")

        with httpx.Client(base_url=url, timeout=opts.turn_timeout_s,
                          event_hooks={"response": [on_response]}) as c:
            for i, turn in enumerate(conv.turns):
                if i and turn.wait_s > 0:
                    time.sleep(turn.wait_s * opts.time_scale)
                if i and turn.strip_reasoning and last is not None:
                    # The client drops the reasoning that opened the last answer.
                    history = [*last[0], *last[1][turn.strip_reasoning:]]
                prompt = [*history, *token_ids(conv, i, turn.new_tokens, trace.vocab_size)]
                rid = f"{cid}:{i}"
                t0 = time.perf_counter()
                answered.clear()
                gen: list[int] | None = None
                reuse: ReuseReport | None = None
                err = ""
                try:
                    gen, reuse = _complete(c, model_name, cid, rid, prompt,
                                           turn.response_tokens)
                except Exception as e:  # noqa: BLE001 - a failed turn is a record, not a crash
                    err = f"{type(e).__name__}: {e}"[:300]
                t1 = time.perf_counter()
                r = _record(spec.name, conv.conversation_id, i, t0 - t_run, t0, t1,
                            tap.take(answered.get("rid") or rid), len(prompt), gen, reuse,
                            err, ledger, cid)
                if served is not None:
                    st = served.take_turn(rid)
                    r.refusal, r.hold_s, r.hold_basis = st.refusal, st.hold_s, st.hold_basis
                    r.hold_samples, r.hold_why = st.hold_samples, st.hold_why
                with rec_lock:
                    records.append(r)
                bar.update(1)
                if gen is None:
                    break  # the history is unknown now: end this conversation
                last = (prompt, gen)
                history = [*prompt, *gen]

    sampler_t = threading.Thread(target=sampler, daemon=True, name="kvtier-ab-sampler")
    sampler_t.start()
    threads = [threading.Thread(target=one, args=(c,), daemon=True,
                                name=f"kvtier-ab-{c.conversation_id}")
               for c in trace.conversations]
    try:
        for t in threads:
            t.start()
            if opts.sequential:
                t.join()
        for t in threads:
            t.join()
    finally:
        stop.set()
        sampler_t.join(timeout=10)
        bar.close()
    t_end = time.perf_counter() - t_run
    xfer = sum(scrape(http, u, "vllm:nixl_xfer_time_seconds_sum") for u in prefill_urls) - xfer0
    _split_transfer(records, xfer)
    records.sort(key=lambda r: (r.t_start, r.conversation_id, r.turn))
    meta: dict[str, Any] = {
        "t_end": t_end, "strategy_spec": spec.model_dump(), "nixl_xfer_time_s": xfer,
        "engine_kv_usage": usage, "instances": [d["name"] for d in stack.describe()],
        "topology": f"{len(stack.prefill)}P{len(stack.decode)}D",
        "engine": probe.finish(http), "engine_kv_blocks": dict(probe.capacity),
        "device_blocks_source": "ledger, capped by decode KV in use" if capped[0] else "ledger",
        "ledger_samples_capped": capped[0]}
    if spec.leases:
        rs = spec.router_settings()
        meta["router_retention"] = {k: rs[k] for k in ("retention", "host_copy",
                                                        "decode_lease_s", "decode_kv_ttl_s")
                                    if k in rs}
        meta["router_retention"].setdefault("retention", "renew")
        if rs.get("cost_refit"):
            meta["router_cost"] = router_cost(http, url, rs["cost_model"])
    counted_s = own.finish(http)
    if math.isfinite(counted_s):
        meta.update(device_block_s_counted=counted_s,
                    device_blocks_source="decode metrics (kvtier_decode_*)")
    elif own.urls:
        meta["device_blocks_source"] = "ledger (decode metrics not readable)"
    return RunResult(spec.name, records, memory, meta)


def router_cost(http: httpx.Client, router_url: str, deployed: dict[str, Any]) -> dict[str, Any]:
    """What the router's online cost refit did (``cost_refit``): refits, and the model in use
    at the end against the one deployed (seconds, from ``kvtier_router_cost_model_seconds``)."""
    text = http.get(f"{router_url}/metrics", timeout=5).text
    terms = {"prefill_fixed": "prefill_a_s", "prefill_per_token": "prefill_b_s_per_token"}
    final = {t: metric(text, "kvtier_router_cost_model_seconds", {"term": t}) for t in terms}
    start = {t: float(deployed.get(k, 0.0)) for t, k in terms.items()}
    for path, link in (deployed.get("reads") or {}).items():
        t = f"{path}_setup"
        final[t] = metric(text, "kvtier_router_cost_model_seconds", {"term": t})
        start[t] = float(link["setup_s"])
    return {"refits": metric(text, "kvtier_router_cost_refits_total"),
            "deployed_s": start, "final_s": final}


def _complete(c: httpx.Client, model: str, cid: str, rid: str, prompt: list[int],
              max_tokens: int) -> tuple[list[int], ReuseReport]:
    """One turn through the router: token-list prompt, exact ids back (see router/client.py),
    and the router's reuse decision from the answer's headers. ``ignore_eos`` makes the turn
    generate exactly the trace's response length."""
    body = {"model": model, "prompt": prompt, "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True, "return_token_ids": True, "conversation_id": cid}
    r = c.post("/v1/completions", json=body, headers={"x-request-id": rid})
    r.raise_for_status()
    ids = r.json()["choices"][0].get("token_ids")
    if not isinstance(ids, list):
        # the router's answer is malformed: a bad value, not a caller passing a wrong type
        raise ValueError("router answer has no token_ids")  # noqa: TRY004
    return ids, parse_reuse_headers(r.headers)


def _record(strategy: str, conv_id: str, i: int, t_start: float, t0: float, t1: float,
            legs: list[Leg], prompt: int, gen: list[int] | None, reuse: ReuseReport | None,
            err: str, ledger: DeviceLedger, cid: str) -> TurnRecord:
    """One turn's record: reuse from the router's headers (``reuse``; None when the turn
    failed), TTFT and what the decode node kept from the legs."""
    path, reused, outcome = ((reuse.path, reuse.tokens, reuse.outcome) if reuse is not None
                             else (ReusePath.NONE, 0, Outcome.NONE))
    pre = next((g for g in legs if g.role == "prefill" and g.ok), None)
    if pre is not None and pre.cached_tokens is not None:
        reused = pre.cached_tokens  # what the engine did, over what the router planned
    dec = next((g for g in reversed(legs) if g.role in ("decode", "direct") and g.ok), None)
    ttft = pre.t1 - t0 if pre is not None else t1 - t0
    if path is ReusePath.DP_READ:
        ledger.read(cid)
    if dec is not None and dec.role == "decode":
        kvp = dec.kv_out or {}
        n = kvp.get("remote_num_tokens")
        if kvp.get("remote_block_ids") and isinstance(n, int):
            ledger.retained(cid, n, time.perf_counter())
    # The enum members themselves: they are str, equal to (and serialized as) their values.
    return TurnRecord(strategy, conv_id, i, prompt, reused, path, max(0, prompt - reused),
                      ttft, t1 - t0, 0.0, t_start, outcome,
                      len(gen) if gen is not None else 0, gen is not None, err)


def _cached_tokens(answer: object) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an engine answer, if it has one."""
    if not isinstance(answer, dict):
        return None
    usage = answer.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    n = details.get("cached_tokens") if isinstance(details, dict) else None
    return n if isinstance(n, int) and n >= 0 else None


def _split_transfer(records: list[TurnRecord], total_s: float) -> None:
    if not (total_s > 0):
        return
    movers = [r for r in records if r.ok and ReusePath(r.reuse_path).is_read
              and r.reused_tokens > 0]
    tokens = sum(r.reused_tokens for r in movers)
    for r in movers:
        r.transfer_s = total_s * r.reused_tokens / tokens


def _bar(total: int, desc: str, enabled: bool) -> tqdm:
    from tqdm import tqdm

    return tqdm(total=total, desc=f"{desc:>16}", unit="turn", disable=not enabled,
                dynamic_ncols=True, leave=True)
