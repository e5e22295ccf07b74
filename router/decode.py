"""The decode leg of the P/D flow: run it, relay it, keep its KV for the next turn.

``DecodeLeg.run`` chooses a decode instance, hands it the prefill's params (``handoff``, with
the router's lease when the node has leases) and serves the client in one of three ways:

- **feed**: decode's own stream is relayed (``stream_capture: stream``); D's params arrive on
  the node's params feed, matched by a tag in the leg's ``X-Request-Id`` (a Responses leg:
  its ``request_id``), while the final ``[DONE]`` is held (``relay.py``);
- **buffered**: decode runs non-streaming, its params and token ids in the answer, and a
  streaming client gets the answer re-emitted as SSE;
- **relay only**: decode's stream is relayed and nothing is kept (``passthrough``, a
  streaming client that named no conversation, a Responses stream without a feed).

What D kept is retained in the store and held by ``Retention``, for the hold it chose before
the leg; a named conversation's turn it would release at once is not kept at all (the leg
asks D to keep nothing: ``kvtier_decode_retain: false``). A leg that fails is retried
on another decode instance (``RetryPolicies.decode``); when none is left, ``run`` returns
the spent ``Attempts`` and the flow serves the request direct.

Threading model: as ``Router``: one event loop.
"""

from __future__ import annotations

import time

from kvtier.ids import ConversationId
from kvtier.router.config import RouterConfig
from kvtier.router.feed import ParamsFeed
from kvtier.router.legs import Legs, UpstreamError
from kvtier.router.metrics import RouterMetrics
from kvtier.router.pool import InstancePool, InstanceState
from kvtier.router.relay import Relay
from kvtier.router.reply import Reply, aiter_of, clean_response, raw_message_tokens
from kvtier.router.requests import Endpoint, decode_body, tagged
from kvtier.router.retention import Held, Retention
from kvtier.router.retry import Attempts, RetryPolicy
from kvtier.router.sse import chat_events, completion_events
from kvtier.router.store import ConversationBackend, RetainedKV
from kvtier.router.turn import Turn
from kvtier.transfer_params import KVTransferParams, NixlParams
from kvtier.wire.leases import ReleaseReason
from kvtier.wire.params_feed import FinishedParams, new_tag


class DecodeLeg:
    def __init__(self, cfg: RouterConfig, pool: InstancePool, policy: RetryPolicy, legs: Legs,
                 feed: ParamsFeed, metrics: RouterMetrics, store: ConversationBackend,
                 retention: Retention, relay: Relay) -> None:
        self.cfg = cfg
        self.pool = pool
        self.policy = policy
        self.legs = legs
        self.feed = feed
        self.metrics = metrics
        self.store = store
        self.retention = retention
        self.relay = relay

    async def run(self, turn: Turn, handoff: NixlParams | None) -> Reply | Attempts:
        """The answer of a decode leg given the prefill's ``handoff``; the spent attempts
        when no decode instance served it."""
        inb = turn.inb
        conv = turn.conversation
        track = conv is not None and handoff is not None
        mode = self.cfg.stream_capture if inb.stream else "buffered"
        run = Attempts(self.policy)
        for _ in run:
            d = self.pool.choose(self.pool.decode, exclude=run.tried)
            if d is None:
                break
            params = handoff if run.kv_usable else None
            # How this leg is run (module docstring): feed, buffered or relay only.
            feed = (track and inb.stream and mode == "stream" and params is not None
                    and self.feed.has(d.name))
            # Without a feed, a streaming client is buffered only for a conversation it
            # named; an unnamed one keeps its token-by-token stream (and no reuse). A
            # Responses stream is never buffered (the router does not rebuild its events).
            relay_only = inb.stream and (mode == "passthrough" or inb.conversation is None
                                         or inb.endpoint is Endpoint.RESPONSES)
            capture = (track and turn.ids is not None and params is not None and not feed
                       and not relay_only)
            upstream_stream = inb.stream and not capture
            turn.log.decode = d.name
            tag = None
            if feed and conv is not None:
                tag = new_tag()
                if self.feed.expect(d.name, tag):
                    turn.log.capture = "feed"
                else:
                    tag = None
            # The hold is chosen before the leg: a turn the policy would release at once is
            # not retained at all (a named conversation's: an unnamed one is found again by
            # the content of the turn the store keeps).
            hold = (self.retention.plan(str(conv), d.name)
                    if (tag is not None or capture) and conv is not None else None)
            body = decode_body(inb, params, turn.ids, stream=upstream_stream, want_ids=capture,
                               lease_s=self.retention.lease_s(d.name),
                               retain=(hold is None or hold.retains
                                       or inb.conversation is None),
                               feed_tag=tag)
            headers = tagged(turn.headers, tag) if tag is not None else turn.headers
            try:
                if upstream_stream:
                    stream = await self.legs.open_stream(d, "decode", inb.endpoint.path, body,
                                                         headers)
                    held = (_FeedCapture(self, turn, d, tag, hold)
                            if tag is not None and conv is not None else None)
                    return Reply(200, stream=self.relay(inb.endpoint, stream, d, held),
                                 log=turn.log, reuse=turn.report)
                resp = await self.legs.post_json(d, "decode", inb.endpoint.path, body,
                                                 turn.headers, self.cfg.timeouts.decode_idle_s)
            except UpstreamError as e:
                if tag is not None:
                    self.feed.forget(d.name, tag)
                self.legs.retrying(run, d, e)
                continue
            except BaseException:
                if tag is not None:
                    self.feed.forget(d.name, tag)
                raise
            if capture and conv is not None and turn.ids is not None:
                await self._retain_answer(turn, conv, d, turn.ids, resp, hold)
            return self._answer(turn, resp)
        return run

    async def _retain_answer(self, turn: Turn, conv: ConversationId, d: InstanceState,
                             ids: tuple[int, ...], resp: dict[str, object],
                             hold: Held | None) -> None:
        """Keep what a non-streamed decode answer says D retained (params and token ids),
        for ``hold`` (planned before the leg)."""
        params = KVTransferParams.from_wire(resp.get("kv_transfer_params"))
        if params is not None and params.nixl is not None and params.nixl.has_remote_blocks:
            turn.log.retained_tokens = params.nixl.remote_num_tokens
        if turn.inb.endpoint is Endpoint.RESPONSES:
            gen = raw_message_tokens(resp.get("output_messages"))
        else:
            choices = resp.get("choices")
            first = choices[0] if isinstance(choices, list) and choices else None
            gen = first.get("token_ids") if isinstance(first, dict) else None
        if params is not None and isinstance(gen, list):
            turn.log.hold = await self.retain(conv, turn.tenant, d, params, [*ids, *gen],
                                              len(ids), hold)

    async def retain_finished(self, turn: Turn, d: InstanceState, msg: FinishedParams,
                              hold: Held | None) -> None:
        """Keep what the decode node's feed said it retained for this leg, for ``hold``
        (planned before the leg; None: chosen now)."""
        params = KVTransferParams.from_wire(msg.kv_transfer_params)
        ids, tokens = turn.ids, msg.token_ids
        if params is None or turn.conversation is None or (
                ids is not None and tokens[:len(ids)] != ids):
            return  # not the prompt this router proved and sent: do not trust it
        await self.retain(turn.conversation, turn.tenant, d, params, list(tokens),
                          len(ids) if ids else 0, hold)

    async def retain(self, conv: ConversationId, tenant: str, d: InstanceState,
                     params: KVTransferParams, token_ids: list[int], prompt_len: int,
                     held: Held | None = None) -> Held | None:
        """Keep D's params for the next turn and start holding its blocks for ``held`` (the
        hold planned before the leg; None: chosen now); the hold (None: nothing held under a
        lease). A turn D kept nothing of (asked to) only starts its conversation's wait."""
        if not params.nixl or not params.nixl.has_remote_blocks:
            self.retention.finished(tenant, str(conv), max(0, len(token_ids) - 1))
            if held is not None and not held.retains:
                self.retention.not_retained(str(conv), d.name, held)
                return held
            return None
        entry = RetainedKV.build(conv, tenant, d.name, params.nixl, token_ids,
                                 time.monotonic() + self.cfg.entry_ttl_s, prompt_len)
        self.retention.finished(tenant, str(conv), len(entry.covered))
        # Written after the answer: not awaited (a write that fails later goes to the
        # store's on_evict, which releases the hold started here).
        if not self.store.put_soon(entry):
            # Not kept (store down or full): nobody will offer these blocks again.
            self.retention.ended(entry, False, ReleaseReason.DROPPED)
            return None
        return self.retention.retained(entry, held)

    def _answer(self, turn: Turn, resp: dict[str, object]) -> Reply:
        inb = turn.inb
        clean_response(resp, inb.client_wants_token_ids)
        if not inb.stream:
            return Reply(200, json=resp, log=turn.log, reuse=turn.report)
        events = (chat_events if inb.endpoint is Endpoint.CHAT else completion_events)(
            resp, inb.include_usage)
        return Reply(200, stream=aiter_of(events), log=turn.log, reuse=turn.report)


class _FeedCapture:
    """A streamed decode leg's params, from the node's feed (``relay.Capture``)."""

    def __init__(self, leg: DecodeLeg, turn: Turn, d: InstanceState, tag: str,
                 hold: Held | None) -> None:
        self.leg, self.turn, self.d, self.tag, self.hold = leg, turn, d, tag, hold

    async def finish(self) -> None:
        leg = self.leg
        msg = await leg.feed.wait(self.d.name, self.tag, leg.cfg.params_wait_s)
        if msg is not None:
            await leg.retain_finished(self.turn, self.d, msg, self.hold)

    def close(self) -> None:
        self.leg.feed.forget(self.d.name, self.tag)
