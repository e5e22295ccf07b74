"""The prefill leg of the P/D flow: choose where, plan the reuse, compute the prompt's KV.

``PrefillLeg.run`` asks the indexer once per request (``/v1/route``: cached prefix per pod
and the best peer host tier), then, per attempt: chooses a prefill (indexer match -> least
in-flight -> round robin), gates the peer source for that prefill (``Route.source_for``, the
one reuse gate), plans the reuse path (``plan.plan``: D->P read of the conversation's
retained turn, peer pull, local cache) and runs the leg (``max_tokens=1``, non-streaming,
``do_remote_decode``) with the router's verified token ids, so no engine re-tokenizes
differently. What it hands the decode leg is the prefill's params (``Prefilled.handoff``).

Faults (``RetryPolicies.prefill``): a leg that cannot connect, times out or answers 5xx is
retried on another instance, its reuse params dropped when they may be the cause; an engine
4xx is retried once without the reuse params when they may be what it refused, else goes to
the client unchanged. When no prefill is left, ``run`` returns the spent ``Attempts``.

A Responses prefill answers the prompt's token ids as vLLM rendered them; reuse planned
from ``/tokenize``'s ids is only trusted when they agree (else the leg runs again without).

Threading model: as ``Router``: one event loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from kvtier.ids import ReusePath
from kvtier.router.config import RouterConfig
from kvtier.router.costs import RouterCost
from kvtier.router.legs import EngineClientError, Legs, UpstreamError
from kvtier.router.metrics import RouterMetrics
from kvtier.router.plan import plan
from kvtier.router.pool import InstancePool
from kvtier.router.reply import Refusal, raw_message_tokens
from kvtier.router.requests import Endpoint, Inbound, prefill_body, tokenize_body
from kvtier.router.retention import Retention
from kvtier.router.retry import Attempts, RetryPolicies
from kvtier.router.turn import Turn
from kvtier.transfer_params import KVTransferParams, NixlParams
from kvtier.wire.reuse_headers import ReuseReport

log = logging.getLogger("kvtier.router")


@dataclass(frozen=True, slots=True)
class Prefilled:
    """A prefill leg that answered."""

    handoff: NixlParams | None  # where the decode reads the prompt's KV (the prefill's params)
    read: bool                  # whether it read the conversation's retained turn (D->P)


class PrefillLeg:
    def __init__(self, cfg: RouterConfig, pool: InstancePool, retry: RetryPolicies,
                 legs: Legs, metrics: RouterMetrics, cost: RouterCost,
                 retention: Retention) -> None:
        self.cfg = cfg
        self.pool = pool
        self.retry = retry
        self.legs = legs
        self.metrics = metrics
        self.cost = cost
        self.retention = retention

    async def run(self, turn: Turn) -> Prefilled | Attempts:
        """Prefill ``turn``'s prompt; fills in ``turn.report`` (and ``turn.ids`` when the
        prefill says them). The spent attempts when no prefill instance answered."""
        inb, conv = turn.inb, turn.conversation
        model_ns = self.cfg.indexer_model or inb.model
        if turn.ids is None and self.legs.indexer is not None:
            # KV-aware choice and peer sources need the prompt's ids: tokenize once.
            turn.ids = await self.tokenize(inb, turn.headers)
        route = (await self.legs.route(model_ns, turn.ids, self.pool.loads())
                 if turn.ids is not None else None)
        matched = route.matched if route is not None else None
        if route is not None and turn.prior_tokens and conv is not None:
            self.retention.host_seen(str(conv), route.host_tokens, turn.prior_tokens)
        reuse = turn.decision.params
        run = Attempts(self.retry.prefill)
        for _ in run:
            p_inst = self.pool.choose(self.pool.prefill, matched, exclude=run.tried)
            if p_inst is None:
                break
            source = (route.source_for(p_inst.name, self.cfg.min_cached_token_delta, model_ns,
                                       self.cfg.block_size) if route is not None else None)
            offered = reuse is not None
            ids = turn.ids
            prompt_tokens = len(ids) if ids is not None else 0
            path, tokens, reuse, source, choice = plan(
                reuse, turn.decision, source, matched, p_inst.name, prompt_tokens,
                self.cost.decision_cost(), self.cost.explore)
            turn.log.choice = choice
            if choice is not None:
                self.cost.chose(prompt_tokens, path, choice.expected_s, choice.explored)
            if offered and path is not ReusePath.DP_READ:
                turn.log.refusal = Refusal.BELOW_THRESHOLD  # another path (or none) was cheaper
            kv = KVTransferParams.prefill_request(reuse=reuse, source=source)
            body = prefill_body(inb, kv, ids, want_ids=conv is not None and ids is None)
            try:
                sent = time.monotonic()
                pre = await self.legs.post_json(p_inst, "prefill", inb.endpoint.path, body,
                                                turn.headers, self.cfg.timeouts.prefill_s)
                self.cost.prefill_leg(_prompt_tokens(ids, pre), path, tokens,
                                      time.monotonic() - sent)
                turn.log.prefill_at = time.perf_counter()
            except EngineClientError:
                if not run.policy.retry_refusal_without_reuse or (reuse is None
                                                                  and source is None):
                    raise
                # Our reuse params may be what the engine refused: retry without.
                if reuse is not None:
                    self.metrics.params_dropped.labels("rejected").inc()
                    reuse = None
                    turn.drop_reuse(Refusal.STALE)
                continue
            except UpstreamError as e:
                self.legs.retrying(run, p_inst, e)
                if not run.kv_usable and reuse is not None:
                    self.metrics.params_dropped.labels("rejected").inc()
                    reuse = None
                continue
            if inb.endpoint is Endpoint.RESPONSES:
                seen = _prompt_ids_of(inb.endpoint, pre)
                if reuse is not None and (seen is None or ids is None
                                          or seen[:tokens] != ids[:tokens]):
                    # vLLM rendered this input otherwise than /tokenize did: the KV it read
                    # from D may not be this prompt's. Prefill again, without it.
                    self.metrics.params_dropped.labels("render_mismatch").inc()
                    log.warning("responses prompt rendered unlike /tokenize; prefilling again "
                                "without reuse", extra={"conversation_id": conv})
                    reuse = None
                    turn.drop_reuse(Refusal.UNPROVEN)
                    continue
                if seen is not None:
                    turn.ids = seen  # what the engines really computed: retained next turn
            self.metrics.reuse.labels(path).inc()
            if reuse is not None:
                self.metrics.reused_tokens.inc(turn.decision.reused_tokens)
            turn.log.prefill, turn.log.path = p_inst.name, path
            turn.log.cached_tokens = _cached_tokens(pre)
            turn.report = ReuseReport(path, tokens, turn.report.outcome)
            if turn.ids is None and conv is not None:
                turn.ids = _prompt_ids_of(inb.endpoint, pre)
            handoff = KVTransferParams.from_wire(pre.get("kv_transfer_params"))
            return Prefilled(handoff.nixl if handoff is not None else None,
                             read=reuse is not None and path is ReusePath.DP_READ)
        return run

    async def tokenize(self, inb: Inbound, headers: dict[str, str]) -> tuple[int, ...] | None:
        """The prompt's token ids as the engines see them; None: serve without a proof."""
        body = tokenize_body(inb)
        if body is None:
            return None
        run = Attempts(self.retry.tokenize)
        for _ in run:
            inst = self.pool.choose(self.pool.prefill or self.pool.decode, exclude=run.tried)
            if inst is None:
                return None
            try:
                out = await self.legs.post_json(inst, "tokenize", "/tokenize", body, headers,
                                                self.cfg.timeouts.tokenize_s)
            except EngineClientError:
                if inb.endpoint is Endpoint.RESPONSES:
                    return None  # our chat rendering of its input; the request may still be fine
                raise
            except UpstreamError as e:
                # Not a leg of the answer: its failures are not counted as retries.
                run.failed(inst.name, e.kind)
                continue
            toks = out.get("tokens")
            if isinstance(toks, list) and all(isinstance(t, int) for t in toks):
                return tuple(toks)
            return None
        return None


def _prompt_ids_of(endpoint: Endpoint, resp: dict[str, Any]) -> tuple[int, ...] | None:
    if endpoint is Endpoint.RESPONSES:
        ids = raw_message_tokens(resp.get("input_messages"))
    elif endpoint is Endpoint.CHAT:
        ids = resp.get("prompt_token_ids")
    else:
        ch = resp.get("choices") or [{}]
        ids = ch[0].get("prompt_token_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return tuple(ids)
    return None


def _prompt_tokens(ids: tuple[int, ...] | None, resp: dict[str, Any]) -> int:
    """The prompt's length: its ids when the router has them, else the engine's usage."""
    if ids is not None:
        return len(ids)
    usage = resp.get("usage")
    n = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    return n if isinstance(n, int) else 0


def _cached_tokens(resp: dict[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an engine answer (the prompt tokens it
    did not compute: prefix cache or loaded KV; vLLM says it with
    ``--enable-prompt-tokens-details``), or None."""
    usage = resp.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    n = details.get("cached_tokens") if isinstance(details, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None
