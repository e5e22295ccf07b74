"""Discrete-event model of a P/D fleet replaying a trace under one retention strategy.

What is modelled (and what the live run measures the same way, so the report's comparison
of the two, `kvtier.ab.report.simulation_error`, is fair):

- **Prefill instances** batch the prefills of concurrent turns, modelled as egalitarian
  processor sharing (``FleetSpec.prefill_sharing="ps"``, the default): a turn starts the
  moment it arrives and, while ``n`` turns are active on the instance, each progresses at
  ``1/n`` of full speed; TTFT = completion − arrival. This is how `kvtier.ab.fit` reads
  service times out of a live run, so a fitted cost model replays consistently.
  ``"fifo"`` serves one prefill at a time instead; TTFT = queue + service. Either way a turn
  goes to the instance with the fewest active and queued turns (ties: lowest index), and
  service = KV read (if any) + prefill of the rest (`CostModel.ttft_s`) + the P→D hand-off
  of the whole prompt when the cost model has a ``"pd_transfer"`` link; the read shares the
  instance like the compute does (as in the fit), and ``transfer_s`` records its unshared time.
- **Decode instances** admit by memory (`kvtier.ab.sim_decode`). A conversation sticks to
  the decode instance its first turn was given (fewest blocks in use). When a turn's prefill
  (and hand-off) is done it needs ``ceil(context/block)`` device blocks (context = prompt +
  response) on that instance; it starts decoding only if they fit in the free blocks
  (``device_blocks_per_decode`` less those of running turns and of retained KV), else it
  waits in the instance's FIFO queue. Waiting turns are let in, in order, whenever blocks free
  up (a turn finishing without retention, a retention expiring, or the next prefill reading
  or forgoing one); the head of the queue blocks those behind it, as in vLLM's scheduler.
  Admitted turns decode concurrently (batched, no interference) and hold their blocks for
  ``response_tokens × decode_s_per_token``. TTFT = arrival → the prefill leg's answer, as the
  live runner measures it (the router's log says when the prefill leg answered, not the
  decode stream); the wait for decode room comes after it, is recorded in the turn's
  ``decode_wait_s`` and is part
  of e2e = TTFT + wait + decode time. The first token a streaming client sees comes from the
  decode node, after that wait: ``ttft_s + decode_wait_s`` (what `kvtier.ab.sizing` holds to
  the SLO; the live runner cannot see the wait per turn, only in e2e and the engine's queue
  metrics). A turn needing more
  blocks than a decode instance has raises ValueError before the replay (it could never start).
- **Device retention** (``device-ttl``, ``tiered*``): when a turn finishes, its decode keeps
  the conversation's blocks for ``decode_ttl_s`` (fixed, not renewed: vLLM's behaviour),
  or until the next turn's prefill has read them. They count against the decode's capacity.
  By default (``FleetSpec.decode_retained="pinned"``) they are not freed for a waiting turn,
  which waits until the retention ends: vLLM frees a retained request's blocks only at its
  TTL or when a prefill reads them, and this memory-versus-reuse trade-off is what the A/B
  measures. With decode leases (``leases``) the chosen hold pins the same way for as long as
  it lasts (a hold of 0 frees the blocks at once). ``"evictable"`` instead evicts retained KV
  (oldest first, the waiting turn's own conversation last) when that lets the head of the
  queue in: an idealised decode treating retention as a cache, and the simulator's rule
  before decode admission was modelled. Retained blocks over time → block-seconds.
- **Host copies** (``host-p2p``, ``tiered*``): a finished turn's context (prompt and
  generated tokens) is stored in its decode pod's host tier, replacing the conversation's
  older copy; LRU eviction at ``host_bytes_per_pod``; held until evicted (no TTL). Bytes held
  over time → GB-seconds. One copy per conversation, on the decode pod: a simplification
  of the connector, which stores on every instance the turn passed through.
- **Reuse** is limited to the *proven prefix* (`kvtier.ab.traces.turn_plan`): with
  ``strip_reasoning > 0`` only the previous prompt is reusable, whatever is held.
  Reusable counts are whole blocks (`kvtier.cost.reuse.reusable_tokens`), on top of the
  prefill's own prefix cache when the strategy enables it and the fleet gives it room.
- **Path choice**: fixed strategies read D→P when at least ``kv_recompute_threshold``
  tokens would be pulled (vLLM's gate), else from a peer host when the delta is at least
  ``min_cached_token_delta``; ``adaptive`` strategies choose by cost per request with the
  live router's own code (`kvtier.cost.learned`: ``choose_path`` over ``LearnedCost``), from
  the cost model their router was deployed with (``StrategySpec.cost_model``; without one,
  the simulated world's, which an online refit would converge to at once), learning from each
  simulated prefill leg as the router does from each timed one where the router's settings
  say so (``cost_learn``: each path's real cost, with its counted exploration; ``cost_refit``).
  Replaying a live run, the world is the run's in-sample fit while the router decided with
  its deployed model: the two differ where a calibration does not match the loaded stack.
- **Adaptive device TTL**: ``adaptive`` strategies re-choose the decode TTL online from
  the tool waits observed so far (`kvtier.cost.retention.choose_device_ttl`, last 512 waits,
  every 8 new ones; TTL 0, no retention, when no TTL pays for its memory); ``online_ttl=False``
  keeps it fixed, as a live vLLM stack without leases must. With decode leases (``leases``,
  live ``tiered-adaptive``) the hold is chosen per conversation and turn as the router does
  (`kvtier.cost.hold.HoldPolicy`: the conversation's own waits after three of them, the
  fleet's before, the router's entry TTL before any), recorded in each turn's ``hold_s`` /
  ``hold_basis``.

- **A shared host** (``FleetSpec.decode_interference`` β > 0, processor sharing only): every
  instance runs on one machine, as the local CPU stack does, and a busy decode slows the
  prefills. While ``k`` decode instances have running turns, a prefill instance works at
  ``1/(1 + β·k)`` of its speed (then shared among its turns as above). β is fitted from a
  live run of the local stack (`kvtier.ab.fit.fit_shared_host`); 0, the default, is a fleet
  of separate machines.

Not modelled: the shape of vLLM's batching beyond processor sharing (token budgets per
step, chunk boundaries, a batch's cost not being the sum of its parts), network contention
between concurrent reads apart from that sharing, the prefills' effect on a decode's speed
(a fitted ``decode_s_per_token`` carries its average).
On the decode: preemption (vLLM preempts running requests under memory pressure and
recomputes them later; here a running turn keeps its blocks to the end and only arrivals
wait), blocks growing as tokens are generated (a turn takes its whole context's blocks at
admission), vLLM's reserved null block, and the order of hand-off and admission (the P→D
hand-off is in the prefill's service, before the wait; a real decode allocates, then pulls).

Where it is written: the replay (event loop, handlers, per-turn accounting) here; a prefill
instance in `kvtier.ab.sim_prefill`; a decode pod (device blocks, waiting turns, host copies)
in `kvtier.ab.sim_decode`; what the strategy decides (path, TTL or hold, online refit) in
`kvtier.ab.sim_policy`.

Threading model: `simulate` is a pure function of its arguments (no globals, no clock,
no randomness), single-threaded; the same inputs give the same `RunResult`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvtier.ab.records import MemorySample, RunResult, TurnRecord
from kvtier.ab.sim_decode import DecodeInstance, HostCopies, Retained
from kvtier.ab.sim_policy import Decisions, SimPolicy
from kvtier.ab.sim_prefill import PrefillInstance, PrefillJob
from kvtier.ab.strategies import StrategySpec, builtin
from kvtier.ab.traces import ConversationSpec, Trace, TurnPlan, turn_plan
from kvtier.cost.decide import Offer
from kvtier.cost.hold import pressure_factor
from kvtier.cost.model import CostModel
from kvtier.cost.reuse import align_down, reusable_tokens
from kvtier.ids import ConversationId, Outcome, ReusePath

PD_TRANSFER = "pd_transfer"  # optional CostModel.reads entry: P->D hand-off of the prompt KV


class FleetSpec(BaseModel):
    """The simulated deployment: instance counts and capacities."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prefill: int = Field(1, ge=1)
    decode: int = Field(1, ge=1)
    device_blocks_per_decode: int = Field(8192, ge=1)
    host_bytes_per_pod: int = Field(8 << 30, ge=0)
    block_size: int = Field(32, ge=1)
    # Prefill's own prefix cache in blocks (used only when the strategy turns prefix caching on).
    prefill_cache_blocks: int = Field(0, ge=0)
    # How a prefill instance serves overlapping turns: "ps" processor sharing (vLLM batches
    # them; what kvtier.ab.fit assumes), "fifo" one at a time.
    prefill_sharing: Literal["ps", "fifo"] = "ps"
    # What retained device KV does when a turn is waiting for room on its decode instance:
    # "pinned" stays until its TTL or hold ends or the next prefill reads it (vLLM's
    # behaviour: the turn waits); "evictable" is evicted, oldest first, when that lets the
    # turn in (an idealised decode treating retention as a cache; the rule before decode
    # admission was modelled).
    decode_retained: Literal["pinned", "evictable"] = "pinned"
    # A shared host (the local CPU stack): while k decode instances are busy, a prefill
    # instance works at 1/(1 + decode_interference * k) of its speed. 0: separate machines.
    # Processor sharing only.
    decode_interference: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _interference_needs_sharing(self) -> FleetSpec:
        if self.decode_interference > 0 and self.prefill_sharing != "ps":
            raise ValueError("decode_interference models a shared host under processor "
                             "sharing; prefill_sharing='fifo' cannot slow a started prefill")
        return self


# Event kinds, in the order they are applied at equal times: expiries and finishes free
# memory before a prefill looks for it; arrivals queue before a start picks the next turn.
# Under processor sharing a turn starts within its arrival (no _START), and _PREFILL_DONE
# carries the instance's epoch instead of the turn.
_EXPIRE, _FINISH, _PREFILL_DONE, _ARRIVE, _START = range(5)


# ------------------------------------------------------------------------------- the replay


class _Sim:
    """One replay: the fleet's instances, the event queue, and the records it writes."""

    def __init__(self, trace: Trace, policy: SimPolicy, fleet: FleetSpec, cost: CostModel,
                 decide_cost: CostModel | None = None) -> None:
        self.trace, self.p, self.fleet, self.cost = trace, policy, fleet, cost
        # what the deployed strategy decides with (paths, holds, TTLs); `cost` times the work
        self.decisions = Decisions(policy, decide_cost or cost)
        self.bs = fleet.block_size
        self.prefills = [PrefillInstance() for _ in range(fleet.prefill)]
        self.decodes = [DecodeInstance(fleet.device_blocks_per_decode,
                                       evict_retained=fleet.decode_retained == "evictable")
                        for _ in range(fleet.decode)]
        self.hosts = [HostCopies(fleet.host_bytes_per_pod) for _ in range(fleet.decode)]
        self.convs: dict[ConversationId, ConversationSpec] = {c.conversation_id: c for c in trace.conversations}
        self.plans: dict[ConversationId, list[TurnPlan]] = {k: turn_plan(c) for k, c in self.convs.items()}
        self.decode_of: dict[ConversationId, int] = {}
        self.events: list[tuple[float, int, int, tuple]] = []
        self.seq = 0
        self.records: list[TurnRecord] = []
        self.memory: list[MemorySample] = []
        self.pending: dict[tuple[ConversationId, int], dict] = {}
        self.host_total = 0  # host bytes held, all pods
        self.counters = {"evicted_device": 0, "expired_device": 0, "decode_queued": 0}
        # turns whose prefill is done, waiting on their decode instance: (pending, ready at)
        self.ready: dict[tuple[ConversationId, int], tuple[dict, float]] = {}
        self.check_fits()
        self.now = 0.0
        # when each conversation's last turn finished, and its context then (tool waits)
        self.finished_at: dict[ConversationId, tuple[float, int]] = {}

    def check_fits(self) -> None:
        """Every turn's context fits one decode instance, else it would wait forever."""
        cap = self.fleet.device_blocks_per_decode
        for conv, plans in self.plans.items():
            for i, plan in enumerate(plans):
                need = math.ceil(plan.context_after / self.bs)
                if need > cap:
                    raise ValueError(
                        f"turn {i} of conversation {conv} needs {need} KV blocks of {self.bs} "
                        f"tokens on its decode instance ({plan.context_after} tokens of context); "
                        f"a decode instance has {cap} (FleetSpec.device_blocks_per_decode), so "
                        "it could never start decoding")

    # -- event plumbing -------------------------------------------------------------------
    def push(self, t: float, kind: int, payload: tuple) -> None:
        heapq.heappush(self.events, (t, kind, self.seq, payload))
        self.seq += 1

    def sample_memory(self) -> None:
        dev, host = sum(d.retained_total for d in self.decodes), self.host_total
        last = self.memory[-1] if self.memory else None
        if last is not None and (last.device_blocks_retained, last.host_bytes_held) == (dev, host):
            return
        if last is not None and last.t == self.now:
            self.memory[-1] = MemorySample(self.p.name, self.now, dev, host)
        else:
            self.memory.append(MemorySample(self.p.name, self.now, dev, host))

    def run(self) -> RunResult:
        self.memory.append(MemorySample(self.p.name, 0.0, 0, 0))
        for conv in self.trace.conversations:
            self.push(conv.start_s, _ARRIVE, (conv.conversation_id, 0))
        fifo = self.fleet.prefill_sharing == "fifo"
        handlers: dict[int, Callable[..., None]] = {_EXPIRE: self.on_expire, _FINISH: self.on_finish,
                    _PREFILL_DONE: self.on_prefill_done if fifo else self.on_shared_done,
                    _ARRIVE: self.on_arrive, _START: self.on_start}
        while self.events:
            t, kind, _, payload = heapq.heappop(self.events)
            self.now = t
            handlers[kind](*payload)
            self.sample_memory()
        if self.ready:  # cannot happen (retention always ends); loud rather than records missing
            raise RuntimeError(f"{self.p.name}: {len(self.ready)} turns never started decoding")
        t_end = max((r.t_start + r.e2e_s for r in self.records), default=0.0)
        self.records.sort(key=lambda r: (r.t_start, r.conversation_id, r.turn))
        meta: dict[str, object] = {
            "simulated": True, "t_end": t_end, "fleet": self.fleet.model_dump(),
            "cost_model": self.cost.model_dump(), "trace": self.trace.name, **self.counters,
            "decode_wait_s": sum(r.decode_wait_s for r in self.records)}
        if self.p.adaptive:
            meta["device_ttl_history"] = self.decisions.ttl_history
            learned = self.decisions.learned_meta()
            if learned:
                meta["router_learning"] = learned
        return RunResult(self.p.name, self.records, [m for m in self.memory if m.t <= t_end], meta)

    # -- handlers ---------------------------------------------------------------------------
    def on_arrive(self, conv: ConversationId, turn: int) -> None:
        if self.p.online_ttl and self.p.ttl_s > 0 and conv in self.finished_at:
            self.observe_wait(conv)
        if conv not in self.decode_of:
            loads = [d.active_blocks + d.retained_blocks() for d in self.decodes]
            self.decode_of[conv] = min(range(len(loads)), key=lambda i: (loads[i], i))
        i = min(range(len(self.prefills)), key=lambda k: (self.prefills[k].load(), k))
        pf = self.prefills[i]
        if self.fleet.prefill_sharing == "fifo":
            pf.queue.append((self.now, conv, turn))
            if not pf.busy:
                self.push(self.now, _START, (i,))
        else:
            pf.admit(self.now, PrefillJob(conv, turn, self.start_turn(pf, self.now, conv, turn)))
            self.schedule_shared_done(i)

    def on_start(self, i: int) -> None:
        """FIFO: the idle instance ``i`` takes its next queued turn."""
        pf = self.prefills[i]
        if pf.busy or not pf.queue:
            return
        arrival, conv, turn = pf.queue.popleft()
        pf.busy = True
        service = self.start_turn(pf, arrival, conv, turn)
        self.push(self.now + service, _PREFILL_DONE, (i, conv, turn))

    def start_turn(self, pf: PrefillInstance, arrival: float, conv: ConversationId, turn: int) -> float:
        """Begin ``turn``'s prefill on ``pf`` now: choose its reuse path, release the device
        copy it reads or forgoes, note its record's fields; returns its service seconds."""
        spec = self.convs[conv].turns[turn]
        plan = self.plans[conv][turn]
        prompt, proven = plan.prompt_tokens, plan.proven_prefix
        d = self.decode_of[conv]
        dec, host = self.decodes[d], self.hosts[d]

        local = 0
        if self.p.local_cache and self.fleet.prefill_cache_blocks:
            local = align_down(min(pf.cache.get(conv, 0), proven), self.bs)
        ret = dec.retained.get(conv)
        if ret is not None and ret.expires < self.now:
            ret = None  # expiry event not yet applied at this exact time
        held_dev = ret.tokens if (ret is not None and self.p.dp_read) else 0
        held_host = host.lookup(conv) if self.p.p2p else 0
        if turn > 0:
            self.decisions.observe_host(conv, held_host, self.plans[conv][turn - 1].context_after)
        offers = [Offer(ReusePath.DP_READ, reusable_tokens(held_dev, proven, local, self.bs)),
                  Offer(ReusePath.P2P, reusable_tokens(held_host, proven, local, self.bs))]
        path, n = self.decisions.choose(prompt, local, offers)
        transfer = self.cost.read_s(path, n) if path else 0.0
        service = self.cost.ttft_s(path, prompt, n, local_tokens=local)
        if PD_TRANSFER in self.cost.reads:
            # After a D->P read the decode node still has those blocks in its
            # prefix cache (freed, not evicted), and vLLM's decode pulls only
            # `tokens - num_computed_tokens` (nixl/pull_scheduler.py): the hand-off
            # covers the newly computed tokens alone.
            handoff = prompt - n if path == ReusePath.DP_READ else prompt
            service += self.cost.read_s(PD_TRANSFER, handoff)
        if ret is not None:
            # The next turn reads (or forgoes) D's copy; either way D frees it now:
            # vLLM's pinned blocks serve exactly one follow-up request.
            self.release_retained(d, conv)
            self.admit(d)

        retained_any = self.p.ttl_s > 0 or self.p.host_copy
        if turn == 0 or not retained_any:
            outcome = Outcome.NONE
        elif not held_dev and not held_host:
            outcome = Outcome.EXPIRED
        elif path is None:
            outcome = Outcome.NONE
        else:
            outcome = Outcome.TRIMMED if spec.strip_reasoning else Outcome.FULL
        reused = local + n
        self.pending[(conv, turn)] = dict(
            arrival=arrival, prompt=prompt, reused=reused,
            reuse_path=ReusePath(path) if path else (ReusePath.LOCAL if local else ReusePath.NONE),
            transfer=transfer, outcome=outcome)
        if self.p.local_cache and self.fleet.prefill_cache_blocks:
            pf.cache_prompt(conv, prompt, self.bs, self.fleet.prefill_cache_blocks)
        return service

    def observe_wait(self, conv: ConversationId) -> None:
        t, tokens = self.finished_at.pop(conv)
        self.decisions.observe_wait(conv, self.now, self.now - t, tokens)

    def schedule_shared_done(self, i: int) -> None:
        t = self.prefills[i].next_done()
        if t is not None:
            self.push(t, _PREFILL_DONE, (i, self.prefills[i].epoch))

    def on_prefill_done(self, i: int, conv: ConversationId, turn: int) -> None:
        """FIFO: ``turn`` is prefilled; instance ``i`` takes the next one."""
        self.prefills[i].busy = False
        self.push(self.now, _START, (i,))
        self.prefill_done(conv, turn)

    def on_shared_done(self, i: int, epoch: int) -> None:
        """Processor sharing: the jobs of instance ``i`` whose work ran out complete."""
        pf = self.prefills[i]
        if epoch != pf.epoch:
            return  # an arrival or completion since rescheduled the instance
        done = pf.take_done(self.now)
        self.schedule_shared_done(i)
        for job in done:
            self.prefill_done(job.conv, job.turn)

    def prefill_done(self, conv: ConversationId, turn: int) -> None:
        """``turn`` is prefilled (and handed off): it waits for room on its decode instance."""
        d = self.decode_of[conv]
        pend = self.pending.pop((conv, turn))
        # the router times the leg now, from send to answer (its ``prefill_leg``)
        self.decisions.observe_leg(pend["prompt"], pend["reuse_path"], pend["reused"],
                                   self.now - pend["arrival"])
        self.ready[(conv, turn)] = (pend, self.now)
        self.decodes[d].enqueue(conv, turn, math.ceil(self.plans[conv][turn].context_after / self.bs))
        self.admit(d)

    def admit(self, d: int) -> None:
        """Start the turns waiting on decode ``d`` that fit now (FIFO; `DecodeInstance.admit`)."""
        started, evicted = self.decodes[d].admit()
        self.counters["evicted_device"] += len(evicted)
        for conv, turn, blocks in started:
            self.start_decode(conv, turn, blocks)
        self.retune()

    def retune(self) -> None:
        """A shared host: set every prefill instance's speed from the decodes busy now."""
        beta = self.fleet.decode_interference
        if beta <= 0:
            return
        busy = sum(1 for dec in self.decodes if dec.active_blocks > 0)
        rate = 1.0 / (1.0 + beta * busy)
        for i, pf in enumerate(self.prefills):
            if pf.rate != rate:
                pf.advance(self.now)
                pf.rate = rate
                self.schedule_shared_done(i)

    def start_decode(self, conv: ConversationId, turn: int, blocks: int) -> None:
        """Record ``turn``: its prefill answered at ``ready_at`` (TTFT, as measured live); it
        decodes from now, after any wait for decode room (``decode_wait_s``, part of e2e)."""
        pend, ready_at = self.ready.pop((conv, turn))
        spec = self.convs[conv].turns[turn]
        wait = self.now - ready_at
        if wait > 0:
            self.counters["decode_queued"] += 1
        ttft = ready_at - pend["arrival"]
        e2e = ttft + wait + spec.response_tokens * self.cost.decode_s_per_token
        rec = TurnRecord(
            strategy=self.p.name, conversation_id=conv, turn=turn, prompt_tokens=pend["prompt"],
            reused_tokens=pend["reused"], reuse_path=pend["reuse_path"],
            computed_tokens=pend["prompt"] - pend["reused"], ttft_s=ttft, e2e_s=e2e,
            transfer_s=pend["transfer"], t_start=pend["arrival"], outcome=pend["outcome"],
            response_tokens=spec.response_tokens, decode_wait_s=wait)
        self.records.append(rec)
        self.decisions.observe_turn(conv, turn, rec)
        self.push(pend["arrival"] + e2e, _FINISH, (conv, turn, blocks))

    def on_finish(self, conv: ConversationId, turn: int, blocks: int) -> None:
        d = self.decode_of[conv]
        dec = self.decodes[d]
        # the node's pressure as a scrape during this turn's decode saw it (router/pressure.py)
        pressure = pressure_factor((dec.active_blocks + dec.retained_total) / dec.capacity,
                                   len(dec.waiting), self.p.hold_waiting_ref)
        dec.finish(blocks)
        tokens = self.plans[conv][turn].context_after
        self.finished_at[conv] = (self.now, tokens)
        ttl = self.decisions.hold_after(conv, turn, pressure)
        if self.p.ttl_s > 0 and ttl > 0:
            # the finished turn's blocks stay, retained (pinned: no waiting turn gets them)
            dec.retain(Retained(conv, blocks, tokens, self.now + ttl))
            self.push(self.now + ttl, _EXPIRE, (d, conv, self.now + ttl))
        self.admit(d)
        if self.p.host_copy:
            host = self.hosts[d]
            before = host.used
            host.store(conv, tokens, tokens * self.cost.kv_bytes_per_token)
            self.host_total += host.used - before
        turns = self.convs[conv].turns
        if turn + 1 < len(turns):
            self.push(self.now + turns[turn + 1].wait_s, _ARRIVE, (conv, turn + 1))

    def on_expire(self, d: int, conv: ConversationId, expires: float) -> None:
        r = self.decodes[d].retained.get(conv)
        if r is not None and r.expires == expires:
            self.release_retained(d, conv)
            self.counters["expired_device"] += 1
            self.admit(d)

    # -- memory helpers -----------------------------------------------------------------------
    def release_retained(self, d: int, conv: ConversationId) -> None:
        self.decodes[d].release(conv)


def simulate(trace: Trace, strategy: StrategySpec | str, fleet: FleetSpec, cost: CostModel,
             online_ttl: bool = True) -> RunResult:
    """Replay ``trace`` under ``strategy`` on ``fleet`` with ``cost``; records like a live run.

    ``strategy`` is a `StrategySpec` or a built-in name (`kvtier.ab.strategies.builtin`).
    The spec's own prefill/decode counts are ignored: the fleet is ``fleet``; its host tier
    size is the spec's ``host_bytes`` where set.
    ``online_ttl``: adaptive strategies re-choose their device TTL as waits arrive; False
    keeps the spec's TTL fixed, as a live vLLM stack does (for comparing with a live run).
    ``cost`` times the work. An adaptive strategy decides (path per turn, device holds) with
    the spec's own ``cost_model`` when it has one -- the model its router was deployed
    with, which a run's in-sample fit need not equal -- else with ``cost``. It learns from
    each turn's simulated prefill leg (arrival to the prefill's answer, queueing included)
    as its router is configured to (``router_settings``: ``cost_learn``, ``cost_refit``;
    ``kvtier.cost.learned``), and prices holds by the decode node's pressure where the
    router's ``hold_pressure`` is on.
    """
    spec = builtin(strategy) if isinstance(strategy, str) else strategy
    if spec.host_bytes is not None:
        # the strategy's own host tier size (``kvtier ab --host-mib``, a regime's host_fraction)
        fleet = fleet.model_copy(update={"host_bytes_per_pod": spec.host_bytes})
    policy = SimPolicy.of(spec, online_ttl)
    needed = (["dp_read"] if policy.dp_read else []) + (["p2p"] if policy.p2p else [])
    missing = [p for p in needed if p not in cost.reads]
    if missing:
        raise ValueError(f"strategy {spec.name} reads over {missing}; the cost model has {sorted(cost.reads)}")
    if cost.block_size != fleet.block_size:
        raise ValueError(f"cost model block_size {cost.block_size} != fleet block_size {fleet.block_size}")
    return _Sim(trace, policy, fleet, cost, spec.cost_model).run()


def simulate_all(trace: Trace, strategies: Sequence[StrategySpec | str], fleet: FleetSpec,
                 cost: CostModel, online_ttl: bool | None = True) -> list[RunResult]:
    """`simulate` for every strategy of ``strategies`` on the same ``trace``, ``fleet`` and
    ``cost``. ``online_ttl=None``: as deployed live -- adaptive strategies with decode leases
    re-choose their device hold online, the others keep the TTL they started with."""
    specs = [builtin(s) if isinstance(s, str) else s for s in strategies]
    return [simulate(trace, s, fleet, cost, online_ttl=s.leases if online_ttl is None else online_ttl)
            for s in specs]
