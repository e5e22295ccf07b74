"""The live A/B runner: replay one trace through each strategy's real stack.

For every strategy: start its stack (``LocalStack``, ≤ 3 instances, one at a
time under the machine-wide lock, ``kvtier.ab.live.lock``), then its indexer when
the strategy uses one and its router, each a process of its own as users deploy
them (``kvtier indexer --config FILE``, ``kvtier router --config FILE``:
``kvtier.ab.live.services``; configs and logs in the run's log directory); replay
the trace (conversation starts and tool waits multiplied by ``time_scale``,
every conversation on its own thread, so the trace's own overlap is the
concurrency); record each turn and sample memory; stop everything
(``try/finally``). The router shares no interpreter with the harness's threads,
so their GIL cannot stall its event loop; its own stalls over the run are in
``meta["router_stalls"]`` (the report shows them).

How each number is measured (also written into the report, ``MEASUREMENT``):

- The runner talks to the router like ``kvtier.router.client.Conversation``
  (token-id history, non-streaming completions, ``ignore_eos`` so a turn
  generates exactly the trace's ``response_tokens``) and tags every turn with
  an ``x-request-id``, which the router logs as ``client_request_id`` on the
  turn's ``served`` line. What the router's answer cannot say comes from that
  line in the router's JSON log file (``kvtier.ab.live.probes.RouterLog``): the
  prefill instance and when its leg answered (``prefill_ms``, of ``ms`` in all),
  the prefill engine's ``cached_tokens`` and what the decode node said it kept
  (``retained_tokens``: its answer's ``remote_num_tokens``).
- ``reuse_path``, ``reused_tokens``, ``outcome``: the router's own decision,
  from its answer's ``x-kvtier-reuse: PATH; tokens=N`` and
  ``x-kvtier-outcome`` headers (``kvtier.wire.reuse_headers``); a failed turn
  records ``none``/0/``none``. Where the prefill engine said how many prompt tokens
  it did not compute, that count wins (a failed or partial load computes more).
  ``computed_tokens`` = prompt - reused.
- ``ttft_s``: client send -> the router's prefill leg answered (the first token
  exists on P; router overhead, indexer calls, D->P/peer reads and the prompt's
  prefill are inside): the client's whole turn less the router's tail after the
  prefill leg answered (``ms - prefill_ms`` of its ``served`` line, so no clocks of
  two processes are compared). The P->D KV move and decode are in ``e2e_s`` only.
  When the router fell back to one instance (no P/D), ttft = e2e.
- ``transfer_s``: the prefill instances' ``vllm:nixl_xfer_time_seconds_sum``
  over the strategy's run, split over reusing turns by transferred tokens (vLLM
  exports no per-request transfer time; peer reads of the host tier are not in
  this metric).
- ``device_blocks_retained``: a ledger of what decode nodes pin: after each
  turn D returns ``remote_num_tokens`` it keeps for ``decoder_kv_blocks_ttl``
  (the decode leg's ``kv_transfer_params``, which the router never shows its
  client and logs as ``retained_tokens``); the blocks are freed when a prefill
  reads them (a ``dp_read`` turn) or at D's TTL. The engines'
  ``vllm:kv_cache_usage_perc`` is sampled too (``meta``).
  When the decode nodes export their own retention metrics (``KVTierNixlConnector`` with
  decode leases, ``kvtier.ab.live.probes.DecodeRetention``) the samples are their
  ``kvtier_decode_blocks_retained`` and block-seconds their own counter
  (``meta["device_blocks_source"]`` says which one a run used).
- ``host_bytes_held``: host-tier blocks per the tier's KV events (the indexer's
  ``GET /v1/pods`` counters: stored - removed, medium CPU) x block bytes from the model
  config.
- ``meta["engine"]``: the engines' own queue time, inter-token latency, preemptions and
  running/waiting peaks (``kvtier.ab.live.probes.EngineProbe``); ``refusal``: the router's
  ``served`` log line for the turn.
- Decode leases (a strategy whose config has them, ``tiered-adaptive``): the router gets each
  decode node's ``lease`` endpoint (``router_instances``) and the strategy's retention
  settings (``StrategySpec.router_settings``: ``retention: adaptive`` with the cost model);
  each turn's ``hold_s`` / ``hold_basis`` / ``hold_samples`` come from the router's ``served``
  line and ``hold_why`` from its ``hold`` line.
- ``meta["services"]``: the router's and the indexer's pid, command, config, log and URL;
  ``meta["path_switches"]``: its cost's ``path switch`` lines (router/costs.py), each with
  ``at_s`` (seconds into the run, from ``meta["t0_wall"]``);
  ``meta["router_stalls"]``: the router's event-loop stalls over its life (this run):
  count and total seconds from its ``kvtier_router_event_loop_stall_seconds`` histogram
  (``/metrics`` at the end), the longest and each one's warning line from its log.
- ``meta["cpu"]``: the machine's busy CPU over the replay against this process tree's (the
  harness and everything it started): what anything else on the machine used
  (``foreign_s``, ``foreign_share`` of wall x cores) and the hypervisor's steal
  (``kvtier.ab.live.cpu``).

One engine per strategy (``StrategySpec.single``, ``kvtier ab --single-engine``): the stack is
one engine and nothing else; the client talks to it (no router, no indexer), each turn
streamed: its TTFT is the first token, its reuse the engine's own ``cached_tokens`` (a
``local`` read: the engine's host tier or vLLM's offloading), host bytes its tier's gauge
(``SINGLE_ENGINE_MEASUREMENT``).

A stack that is already running (``run_on_stack``, ``kvtier ab --stack``) is replayed through
its own router too, but its log is not this run's to read: no router log, no ledger. Each
turn is streamed and its TTFT is the first token; device blocks are the decode nodes' own
retention metrics or their KV in use; host bytes the host tiers' gauges or the stack's indexer
(``kvtier.ab.live.running.MEASUREMENT``). Both kinds of run share ``_replay``, told apart by
their ``Target``.

Where it is written: the run (options, replay, sampling, the result's meta) here; how a turn
is measured (the logged legs, device ledger, the turn's record) in
``kvtier.ab.live.measure``; the router's log in ``kvtier.ab.live.probes``; the router and
indexer processes in ``kvtier.ab.live.services``; the stack a strategy is deployed on (its
spec, the router's instances) in ``kvtier.ab.live.stacks``; a running stack (discovery,
checks, the streamed turn) in ``kvtier.ab.live.running``.

Threading model: ``run_strategy`` is called from one thread; it owns one
thread per conversation and a sampler thread, and joins all of them before it
returns; the router and the indexer are child processes, stopped (SIGTERM, then
SIGKILL) before it returns.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from kvtier.ab.live import cpu
from kvtier.ab.live.measure import (
    DeviceLedger,
    complete_turn,
    logged_legs,
    split_transfer,
    turn_record,
)
from kvtier.ab.live.probes import (
    DecodeRetention,
    Endpoint,
    EngineProbe,
    RouterLog,
    lease_metrics_urls,
)
from kvtier.ab.live.running import RunningStack, stream_turn, tier_bytes
from kvtier.ab.live.running import host_bytes as running_host_bytes
from kvtier.ab.live.scrape import metric, page, scrape
from kvtier.ab.live.services import (
    Service,
    answers_healthz,
    await_indexer_streams,
    free_port,
    indexer_config,
    router_config,
    router_stalls,
    start_service,
)
from kvtier.ab.live.stacks import (
    StackProvider,
    locked_stack,
    router_instances,
    stack_spec_for,
)
from kvtier.ab.records import MemorySample, RunResult, TurnRecord
from kvtier.ab.strategies import StrategySpec
from kvtier.ab.traces import ConversationSpec, Trace, token_ids
from kvtier.devstack.placement import SPINNER_NICE
from kvtier.devstack.stack import LocalStack
from kvtier.router.config import RouterConfig
from kvtier.tier.accounting import PEER_PHASES
from kvtier.wire.reuse_headers import ReuseReport

if TYPE_CHECKING:
    from tqdm import tqdm

log = logging.getLogger("kvtier.ab")

MEASUREMENT = {
    "ttft_s": "client send -> router's prefill leg answered (first token computed on P; includes "
              "router, indexer, D->P/peer reads, prefill): the client's whole turn less the "
              "router's tail after its prefill leg answered (ms - prefill_ms of the router "
              "process's served log line). P->D move and decode only in e2e_s",
    "e2e_s": "client send -> full non-streaming answer from the router",
    "reused_tokens": "the prefill engine's cached_tokens (the router's served log line), else "
                     "the router's x-kvtier-reuse header (tokens=N: prompt tokens reused); "
                     "computed = prompt - reused",
    "reuse_path": "the router's x-kvtier-reuse header (dp_read, p2p, local, none)",
    "outcome": "the router's x-kvtier-outcome header (full, trimmed, stale, expired, none)",
    "transfer_s": "prefill instances' vllm:nixl_xfer_time_seconds_sum over the run, split over "
                  "reusing turns by transferred tokens (peer host-tier reads not included)",
    "device_blocks_retained": "ledger of decode-pinned KV: D's remote_num_tokens after each turn "
                              "(retained_tokens of the router's served log line), "
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
    "router / indexer": "each its own process (kvtier router|indexer --config FILE), started "
                        "for the strategy's run; pids, commands, configs and logs in meta "
                        "services",
    "cpu (foreign)": "the machine's busy CPU over the replay (/proc/stat) less the CPU of the "
                     "harness's process tree (itself, the stack, router and indexer it started): "
                     "what anything else on the machine used, and the hypervisor's steal",
    "router event-loop stalls": "the router's kvtier_router_event_loop_stall_seconds (count, "
                                "sum) from its /metrics at the end of the run, and its "
                                "watchdog's warning lines (the longest stall) from its log",
    "hold_s / hold_basis": "decode leases: the router's served log line -- how long it chose to "
                           "hold the turn's device KV (0: released at once) and on what basis "
                           "(renew; adaptive: the conversation's own waits, the fleet's, or "
                           "the default before any wait was seen)",
}


# What a run with one engine per strategy measures differently (the rest as above).
SINGLE_ENGINE_MEASUREMENT = {
    "ttft_s": "one engine per strategy: client send -> first streamed token from the engine "
              "(no router; the engine computes and decodes the turn)",
    "e2e_s": "one engine per strategy: client send -> the stream's last event",
    "reused_tokens": "one engine per strategy: the engine's usage.prompt_tokens_details."
                     "cached_tokens (its host tier or vLLM's offloading; its own prefix cache "
                     "is off); reuse_path local when > 0",
    "device_blocks_retained": "one engine per strategy: none (no decode node retains KV)",
    "host_bytes_held": "one engine per strategy: the host tier's kvtier_tier_bytes_held "
                       "(vLLM's offloading exports no such gauge: 0)",
}


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
    # NIXL's spinning progress threads in the local stack: nice 0-19, or None for SCHED_IDLE
    # (``--spinner-nice``; kvtier.devstack.placement).
    spinner_nice: int | None = SPINNER_NICE
    # A regime's stack settings (kvtier.ab.regimes): vLLM arguments for every instance and
    # per role ("prefill"/"decode"), environment per role.
    extra_args: tuple[str, ...] = ()
    role_args: dict[str, tuple[str, ...]] = field(default_factory=dict)
    role_env: dict[str, dict[str, str]] = field(default_factory=dict)


def run_strategy(spec: StrategySpec, trace: Trace, opts: RunOptions,
                 stack_provider: StackProvider = locked_stack,
                 stack: LocalStack | None = None) -> RunResult:
    """Run ``trace`` through ``spec``'s stack. ``stack``: an already running one (tests)."""
    spec = spec.scaled(opts.time_scale)
    sspec = stack_spec_for(spec, opts.model, block_size=opts.block_size,
                           max_model_len=opts.max_model_len, extra_args=opts.extra_args,
                           role_args=opts.role_args, role_env=opts.role_env,
                           spinner_nice=opts.spinner_nice)
    run = _run_single if spec.single_engine else _run_on
    if stack is not None:
        return run(spec, trace, opts, stack)
    with stack_provider(sspec, opts.log_dir / spec.name) as st:
        return run(spec, trace, opts, st)


def run_on_stack(spec: StrategySpec, stack: RunningStack, trace: Trace,
                 opts: RunOptions) -> RunResult:
    """Run ``trace`` through a stack that is already running, through its own router
    (``kvtier.ab.live.running``): nothing is started or configured; TTLs are the stack's, so
    only the trace's waits are time-scaled. ``spec`` labels the run."""
    block_bytes = opts.block_size * opts.kv_bytes_per_token
    target = Target(
        url=stack.url, model_name=stack.model_name, engines=list(stack.engines),
        decode_metrics=list(stack.decode_metrics),
        host_bytes=lambda c: running_host_bytes(c, stack, block_bytes),
        instances=[i.name for i in stack.instances], topology=stack.topology,
        prefill_urls=[e.url for e in stack.engines if e.role in ("prefill", "both")],
        stack_is_ours=False)
    with httpx.Client(timeout=30) as http:
        return _replay(spec.scaled(opts.time_scale), trace, opts, target, http)


@dataclass
class Target:
    """What one run replays the trace against: a router, the engines' metrics pages, and --
    for a local stack, whose router this run started -- the router's log (then each turn is
    sent whole and its legs are read from the router's ``served`` line; without it each
    turn is streamed and its TTFT is the first token)."""

    url: str                                   # the router
    model_name: str
    engines: list[Endpoint]                    # vLLM /metrics pages
    decode_metrics: list[str]                  # decode nodes' own retention metrics
    host_bytes: Callable[[httpx.Client], int]  # host-tier bytes held now
    instances: list[str]
    topology: str
    prefill_urls: list[str]
    router_log: RouterLog | None = None
    direct: bool = False  # ``url`` is one engine, not a router (one engine per strategy)
    # (instance, its host tier's metrics page) per host tier: peer fetches read from them
    tier_pages: list[tuple[str, str]] = field(default_factory=list)
    stack_is_ours: bool = True  # started by this process (its CPU is not foreign: meta cpu)


def _run_single(spec: StrategySpec, trace: Trace, opts: RunOptions,
                stack: LocalStack) -> RunResult:
    """Replay ``trace`` straight at ``stack``'s one engine (``StrategySpec.single``): no router
    and no indexer are started; the engine's host tier, if any, is read from its own metrics
    page."""
    (inst,) = stack.instances
    tier_page = f"http://127.0.0.1:{inst.spec.tier_metrics_port}"  # its /metrics

    def host_bytes(c: httpx.Client) -> int:
        return tier_bytes(c, [tier_page]) if spec.host_tier else 0

    target = Target(url=inst.url, model_name=Path(opts.model).name,
                    engines=[Endpoint(inst.spec.name, inst.spec.role.value, inst.url)],
                    decode_metrics=[], host_bytes=host_bytes,
                    instances=[d["name"] for d in stack.describe()],
                    topology="1 engine (no P/D)", prefill_urls=[inst.url], direct=True)
    with httpx.Client(timeout=30) as http:
        return _replay(spec, trace, opts, target, http)


def _run_on(spec: StrategySpec, trace: Trace, opts: RunOptions, stack: LocalStack) -> RunResult:
    """Serve ``stack`` through its own router process (and indexer process, when ``spec``
    uses one), started here with their configs and logs in the run's log directory, and
    replay ``trace`` through that router."""
    model_name = Path(opts.model).name
    log_dir = opts.log_dir / spec.name
    with contextlib.ExitStack() as es:
        services: dict[str, Service] = {}
        idx_url = None
        if spec.use_indexer:
            icfg = indexer_config(stack, model_name, opts.block_size, free_port())
            idx = es.enter_context(start_service("indexer", icfg, log_dir, answers_healthz))
            services["indexer"], idx_url = idx, idx.url
            await_indexer_streams(idx_url)
        rcfg = router_config(router_instances(stack), idx_url, model_name, opts.block_size,
                             opts.turn_timeout_s, free_port(), spec.router_settings())
        RouterConfig.model_validate(rcfg)  # a bad config fails here, not in the process
        router = es.enter_context(start_service("router", rcfg, log_dir, answers_healthz))
        services["router"] = router
        http = es.enter_context(httpx.Client(timeout=30))
        block_bytes = opts.block_size * opts.kv_bytes_per_token

        def host_bytes(c: httpx.Client) -> int:
            if idx_url is None:
                return 0
            try:
                pods = c.get(f"{idx_url}/v1/pods", timeout=5).json().get("pods") or {}
                return sum(max(0, int(p["blocks_stored"]) - int(p["blocks_removed"]))
                           for p in pods.values()) * block_bytes
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
                return 0

        rlog = RouterLog(router.log)
        target = Target(
            url=router.url, model_name=model_name,
            engines=[Endpoint(i.spec.name, i.spec.role.value, i.url) for i in stack.instances],
            decode_metrics=lease_metrics_urls([i.spec.side_channel_port for i in stack.decode],
                                              stack.spec.kv_transfer_config),
            host_bytes=host_bytes, instances=[d["name"] for d in stack.describe()],
            topology=f"{len(stack.prefill)}P{len(stack.decode)}D",
            prefill_urls=[i.url for i in stack.prefill], router_log=rlog,
            tier_pages=[(i.spec.name, f"http://127.0.0.1:{i.spec.tier_metrics_port}")
                        for i in stack.instances] if spec.host_tier else [])
        res = _replay(spec, trace, opts, target, http)
        res.meta["services"] = {n: s.describe() for n, s in services.items()}
        for name, svc in services.items():
            if svc.proc.poll() is not None:  # its turns failed: the records say so
                res.meta["services"][name]["exited"] = svc.proc.returncode
                log.error("the %s process exited (%s) during the run; its log: %s", name,
                          svc.proc.returncode, svc.log)
        rlog.read()
        res.meta["router_stalls"] = router_stalls(page(http, router.url), rlog.stalls,
                                                  rlog.longest_stall_s)
        t0 = res.meta["t0_wall"]  # set by _replay
        res.meta["path_switches"] = [
            {**sw, "at_s": round(sw["ts"] - t0, 1)} if isinstance(sw.get("ts"), (int, float))
            else sw for sw in rlog.switches]
        return res


def _replay(spec: StrategySpec, trace: Trace, opts: RunOptions, target: Target,
            http: httpx.Client) -> RunResult:
    rlog = target.router_log
    # Without the router's log no decode leg is seen: no ledger, the decode engines' KV in use
    # instead.
    ledger = (DeviceLedger(opts.block_size, spec.decode_ttl_s if spec.device_retention else None)
              if rlog is not None else None)
    records: list[TurnRecord] = []
    memory: list[MemorySample] = []
    usage: list[dict[str, float]] = []
    probe = EngineProbe(target.engines)
    own = DecodeRetention(target.decode_metrics)
    probe.start(http)
    own.start(http)
    rec_lock = threading.Lock()
    stop = threading.Event()
    xfer0 = sum(scrape(http, u, "vllm:nixl_xfer_time_seconds_sum") for u in target.prefill_urls)
    peer0 = peer_fetches(http, target.tier_pages)
    total = sum(len(c.turns) for c in trace.conversations)
    bar = _bar(total, spec.name, opts.progress)
    cpu0 = cpu.snapshot()
    t_run = time.perf_counter()
    t_wall = time.time()  # the router's log lines carry wall-clock times

    capped = [0]  # ledger samples over the decode engines' blocks in use

    def sampler() -> None:
        with httpx.Client(timeout=5) as c:
            while True:
                now = time.perf_counter()
                counted = own.sample(c)
                u = probe.sample(c)
                in_use = probe.decode_blocks_in_use(u)
                if math.isfinite(counted):
                    blocks = int(counted)
                elif ledger is None:
                    blocks = math.ceil(in_use) if math.isfinite(in_use) else 0
                else:
                    # The ledger assumes D keeps every turn until read or TTL; a full decode
                    # node cannot hold more than it has in use (seen: a decode-scarce run's
                    # ledger averaged 288 retained blocks on a 160-block decode at 92% usage).
                    blocks = ledger.blocks(now)
                    if math.isfinite(in_use) and blocks > in_use:
                        blocks = math.ceil(in_use)
                        capped[0] += 1
                memory.append(MemorySample(spec.name, now - t_run, blocks, target.host_bytes(c)))
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
        with httpx.Client(base_url=target.url, timeout=opts.turn_timeout_s) as c:
            for i, turn in enumerate(conv.turns):
                if i and turn.wait_s > 0:
                    time.sleep(turn.wait_s * opts.time_scale)
                if i and turn.strip_reasoning and last is not None:
                    # The client drops the reasoning that opened the last answer.
                    history = [*last[0], *last[1][turn.strip_reasoning:]]
                prompt = [*history, *token_ids(conv, i, turn.new_tokens, trace.vocab_size)]
                rid = f"{cid}:{i}"
                t0 = time.perf_counter()
                gen: list[int] | None = None
                reuse: ReuseReport | None = None
                first: float | None = None
                err = ""
                try:
                    if rlog is not None:
                        gen, reuse = complete_turn(c, target.model_name, cid, rid, prompt,
                                                   turn.response_tokens)
                    else:
                        gen, reuse, first = stream_turn(c, target.model_name, cid, rid, prompt,
                                                        turn.response_tokens,
                                                        direct=target.direct)
                except Exception as e:  # noqa: BLE001 - a failed turn is a record, not a crash
                    err = f"{type(e).__name__}: {e}"[:300]
                t1 = time.perf_counter()
                # The router's served line for this turn (kept by the client's x-request-id);
                # a failed turn may have none, so it is not waited for.
                st = (rlog.take_turn(rid, wait_s=2.0 if gen is not None else 0.0)
                      if rlog is not None else None)
                legs = logged_legs(st, t0, t1) if st is not None else []
                r = turn_record(spec.name, conv.conversation_id, i, t0 - t_run, t0, t1, legs,
                                len(prompt), gen, reuse, err, ledger, cid,
                                first_token=first)
                if st is not None:
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
    cpu_used = cpu.account(cpu0, cpu.snapshot(), target.stack_is_ours)
    xfer = sum(scrape(http, u, "vllm:nixl_xfer_time_seconds_sum")
               for u in target.prefill_urls) - xfer0
    split_transfer(records, xfer)
    peer = {pod: {k: v - peer0[pod].get(k, 0.0) for k, v in d.items()}
            for pod, d in peer_fetches(http, target.tier_pages).items() if pod in peer0}
    records.sort(key=lambda r: (r.t_start, r.conversation_id, r.turn))
    if target.direct:
        source = "none (one engine per strategy: no decode node)"
    elif ledger is None:
        source = "decode KV in use (vllm:kv_cache_usage_perc x num_gpu_blocks)"
    else:
        source = "ledger, capped by decode KV in use" if capped[0] else "ledger"
    meta: dict[str, Any] = {
        "t_end": t_end, "t0_wall": t_wall, "strategy_spec": spec.model_dump(),
        "nixl_xfer_time_s": xfer,
        "engine_kv_usage": usage, "instances": target.instances, "topology": target.topology,
        "engine": probe.finish(http), "engine_kv_blocks": dict(probe.capacity),
        "device_blocks_source": source, "ledger_samples_capped": capped[0]}
    if cpu_used is not None:
        meta["cpu"] = cpu_used
    if peer:
        meta["peer_fetch"] = peer
    if spec.leases and rlog is not None:
        rs = spec.router_settings()
        meta["router_retention"] = {k: rs[k] for k in ("retention", "host_copy",
                                                        "decode_lease_s", "decode_kv_ttl_s")
                                    if k in rs}
        meta["router_retention"].setdefault("retention", "renew")
        if rs.get("cost_refit"):
            meta["router_cost"] = router_cost(http, target.url, rs["cost_model"])
    if rlog is not None:
        meta["router_faults"] = router_faults(http, target.url)
    counted_s = own.finish(http)
    if math.isfinite(counted_s):
        meta.update(device_block_s_counted=counted_s,
                    device_blocks_source="decode metrics (kvtier_decode_*)")
    elif own.urls:
        meta["device_blocks_source"] = f"{source} (decode metrics not readable)"
    return RunResult(spec.name, records, memory, meta)


def peer_fetches(http: httpx.Client, pages: list[tuple[str, str]]) -> dict[str, dict[str, float]]:
    """Each readable host tier's peer fetches so far: ``{instance: {"fetches": n, phase:
    seconds, ...}}`` (``kvtier_tier_peer_fetches_total``, ``..._peer_fetch_seconds_total``)."""
    out: dict[str, dict[str, float]] = {}
    for pod, url in pages:
        text = page(http, url)
        if text is None:
            continue
        try:
            d = {"fetches": metric(text, "kvtier_tier_peer_fetches_total")}
            for phase in PEER_PHASES:
                d[phase] = metric(text, "kvtier_tier_peer_fetch_seconds_total", {"phase": phase})
        except ValueError:  # a malformed page: this tier's fetches are not reported
            continue
        out[pod] = d
    return out


# The router's own counts of what went wrong during a run: a turn served by a fallback is
# a turn measured on another path, and the report must be able to say so.
_FAULT_METRICS = ("kvtier_router_upstream_errors_total", "kvtier_router_retries_total",
                  "kvtier_router_instance_ejections_total",
                  "kvtier_router_indexer_unavailable_total",
                  "kvtier_router_event_loop_stall_seconds_count")


def router_faults(http: httpx.Client, router_url: str) -> list[str]:
    """The non-zero fault samples of the router's ``/metrics`` (failed legs by kind, retries,
    ejections, indexer calls that failed, event-loop stalls) at the end of a run."""
    try:
        text = http.get(f"{router_url}/metrics", timeout=5).text
    except httpx.HTTPError as e:
        return [f"unreadable: {e!r}"]
    return [ln for ln in text.splitlines()
            if ln.startswith(_FAULT_METRICS) and not ln.rstrip().endswith(" 0.0")]


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


def _bar(total: int, desc: str, enabled: bool) -> tqdm:
    from tqdm import tqdm

    return tqdm(total=total, desc=f"{desc:>16}", unit="turn", disable=not enabled,
                dynamic_ncols=True, leave=True)
