"""The decode half of the P/D flow: run the decode leg, relay it, keep its KV for the next turn.

``DecodeLeg`` is a part of ``Router`` (flow.py), split out to keep each file readable: it
chooses a decode instance, hands it the prefill's params (with the router's lease when the
node has leases), and either relays decode's own stream (``stream_capture: stream``; D's
params arrive on the node's params feed, matched by a tag in the leg's ``X-Request-Id``,
while the final ``[DONE]`` is held) or runs it non-streaming to capture D's params from the
answer (``buffered``). What D kept is retained in the store and held by ``Retention``.

Threading model: as ``Router``: one event loop.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from kvtier.router.config import RouterConfig
from kvtier.router.feed import ParamsFeed
from kvtier.router.legs import Legs, StreamBroken, UpstreamError
from kvtier.router.metrics import RouterMetrics
from kvtier.router.pool import InstancePool, InstanceState
from kvtier.router.reply import Reply, aiter_of, clean_response, raw_message_tokens
from kvtier.router.requests import Endpoint, Inbound, decode_body
from kvtier.router.retention import Retention
from kvtier.router.retry import Attempts, RetryPolicies
from kvtier.router.sse import (
    DONE,
    RESPONSE_END_TYPES,
    Garbage,
    chat_events,
    clean_named_event,
    completion_events,
    error_event,
    named_events,
    responses_error_event,
    strip_params,
)
from kvtier.router.store import ConversationBackend, RetainedKV

from kvtier.ids import ConversationId, Outcome
from kvtier.transfer_params import KVTransferParams
from kvtier.wire.leases import ReleaseReason
from kvtier.wire.params_feed import FinishedParams, new_tag
from kvtier.wire.reuse_headers import ReuseReport


class DecodeLeg:
    """Router's decode leg (a mixin: ``Router`` provides the attributes and the fallbacks)."""

    cfg: RouterConfig
    pool: InstancePool
    retry: RetryPolicies
    legs: Legs
    feed: ParamsFeed
    metrics: RouterMetrics
    store: ConversationBackend
    retention: Retention

    def _retrying(self, run: Attempts, inst: InstanceState, e: UpstreamError) -> None:
        raise NotImplementedError

    async def _exhausted(self, run: Attempts, last: UpstreamError | None, inb: Inbound,
                         headers: dict[str, str], outcome: Outcome) -> Reply:
        raise NotImplementedError

    async def _decode(self, inb: Inbound, headers: dict[str, str], tenant: str,
                      conv: ConversationId | None, ids: tuple[int, ...] | None,
                      p_params: dict[str, Any] | None, info: dict[str, Any],
                      report: ReuseReport) -> Reply:
        track = conv is not None and p_params is not None
        mode = self.cfg.stream_capture if inb.stream else "buffered"
        run = Attempts(self.retry.decode)
        for _ in run:
            d = self.pool.choose(self.pool.decode, exclude=run.tried)
            if d is None:
                break
            params = p_params if run.kv_usable else None
            if params is not None:
                params = self.retention.leg_params(d.name, params)
            # How this leg is run: streamed with its params from the decode node's feed,
            # non-streaming with its params in the answer (buffered), or streamed without
            # keeping anything (passthrough, or nothing to keep).
            feed = (track and inb.stream and mode == "stream" and params is not None
                    and self.feed.has(d.name))
            # Without a feed, a streaming client is buffered only for a conversation it
            # named; an unnamed one keeps its token-by-token stream (and no reuse). A
            # Responses stream is never buffered (the router does not rebuild its events).
            relay_only = inb.stream and (mode == "passthrough" or inb.conversation is None
                                         or inb.endpoint is Endpoint.RESPONSES)
            capture = (track and ids is not None and params is not None and not feed
                       and not relay_only)
            upstream_stream = inb.stream and not capture
            body = decode_body(inb, params, ids, stream=upstream_stream, want_ids=capture)
            info["decode"] = d.name
            leg_headers, tag = headers, None
            if feed and conv is not None:
                tag = new_tag()
                if self.feed.expect(d.name, tag):
                    rid = headers.get("x-request-id", "")
                    leg_headers = {**headers, "x-request-id": f"{rid}-{tag}" if rid else tag}
                    if inb.endpoint is Endpoint.RESPONSES:
                        # vLLM's Responses request id is a body field, not the header
                        body["request_id"] = f"resp_{tag}"
                    info["capture"] = "feed"
                else:
                    tag = None
            try:
                if upstream_stream:
                    stream = await self.legs.open_stream(d, "decode", inb.endpoint.path, body,
                                                         leg_headers)
                    relay = self._relay_for(inb)(stream, d, tag, conv if tag else None,
                                                 tenant, ids)
                    return Reply(200, stream=relay, info=info, reuse=report)
                resp = await self.legs.post_json(d, "decode", inb.endpoint.path, body, headers,
                                                 self.cfg.timeouts.decode_idle_s)
            except UpstreamError as e:
                if tag is not None:
                    self.feed.forget(d.name, tag)
                self._retrying(run, d, e)
                continue
            except BaseException:
                if tag is not None:
                    self.feed.forget(d.name, tag)
                raise
            if capture and conv is not None and ids is not None:
                params_of = KVTransferParams.from_wire(resp.get("kv_transfer_params"))
                if inb.endpoint is Endpoint.RESPONSES:
                    gen = raw_message_tokens(resp.get("output_messages"))
                else:
                    choices = resp.get("choices") or []
                    gen = choices[0].get("token_ids") if choices else None
                if params_of is not None and isinstance(gen, list):
                    info.update(await self._retain(conv, tenant, d, params_of, [*ids, *gen],
                                                   len(ids)))
            return self._answer(inb, resp, info, report)
        return await self._exhausted(run, None, inb, headers, report.outcome)

    def _relay_for(self, inb: Inbound) -> Callable[..., AsyncIterator[bytes]]:
        """How a decode (or direct) leg's stream is relayed: Responses events or chunks."""
        return self._relay_responses if inb.endpoint is Endpoint.RESPONSES else self._relay

    async def _relay(self, stream: AsyncIterator[bytes], d: InstanceState, tag: str | None,
                     conv: ConversationId | None, tenant: str,
                     ids: tuple[int, ...] | None) -> AsyncIterator[bytes]:
        """Relay a decode leg's stream with engine transfer params taken out. With a feed
        ``tag``, hold the final ``[DONE]`` until the decode node's params for this leg
        arrived (or ``params_wait_s`` passed) and are retained, so a client that sends its
        next turn on ``[DONE]`` finds them."""
        inline: list[dict[str, Any]] = []
        done = False
        try:
            try:
                async for events in strip_params(stream, inline.append):
                    if events.endswith(DONE):
                        done = True
                        if tag is not None:
                            events = events[:-len(DONE)]
                            if not events:
                                continue
                    yield events
            except Garbage as e:
                self.legs.midstream("decode", d, f"not SSE: {e}")
                yield error_event("upstream decode sent a malformed stream")
                yield DONE
                return
            except StreamBroken as e:
                yield error_event(str(e))
                yield DONE
                return
            if not done:
                # The engine's stream ended without [DONE]: it died or was cut.
                self.legs.midstream("decode", d, "stream ended without [DONE]")
                yield error_event("upstream decode ended the stream early")
                yield DONE
                return
            if inline:
                self.metrics.params_in_stream.inc(len(inline))
            if tag is not None and conv is not None:
                msg = await self.feed.wait(d.name, tag, self.cfg.params_wait_s)
                if msg is not None:
                    await self._retain_finished(conv, tenant, d, ids, msg)
            if tag is not None:
                yield DONE
        finally:
            if tag is not None:
                self.feed.forget(d.name, tag)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def _relay_responses(self, stream: AsyncIterator[bytes], d: InstanceState,
                               tag: str | None, conv: ConversationId | None, tenant: str,
                               ids: tuple[int, ...] | None) -> AsyncIterator[bytes]:
        """Relay a decode leg's Responses stream (named events; it ends with the response in
        its final state, no ``[DONE]``) with engine transfer params taken out. With a feed
        ``tag``, hold that last event until the decode node's params for this leg arrived
        (or ``params_wait_s`` passed) and are retained, as ``_relay`` holds ``[DONE]``."""
        last = None
        try:
            try:
                async for event in named_events(stream):
                    out, kind, _ = clean_named_event(event)
                    if kind in RESPONSE_END_TYPES:
                        last = out
                        continue
                    yield out
            except StreamBroken as e:
                yield responses_error_event(str(e))
                return
            if last is None:
                self.legs.midstream("decode", d, "stream ended before the response did")
                yield responses_error_event("upstream decode ended the stream early")
                return
            if tag is not None and conv is not None:
                msg = await self.feed.wait(d.name, tag, self.cfg.params_wait_s)
                if msg is not None:
                    await self._retain_finished(conv, tenant, d, ids, msg)
            yield last
        finally:
            if tag is not None:
                self.feed.forget(d.name, tag)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def _retain_finished(self, conv: ConversationId, tenant: str, d: InstanceState,
                               ids: tuple[int, ...] | None, msg: FinishedParams) -> None:
        """Keep what the decode node's feed said it retained for this leg."""
        params = KVTransferParams.from_wire(msg.kv_transfer_params)
        tokens = msg.token_ids
        if params is None or (ids is not None and tokens[:len(ids)] != ids):
            return  # not the prompt this router proved and sent: do not trust it
        await self._retain(conv, tenant, d, params, list(tokens), len(ids) if ids else 0)

    async def _retain(self, conv: ConversationId, tenant: str, d: InstanceState,
                      params: KVTransferParams, token_ids: list[int], prompt_len: int,
                      ) -> dict[str, Any]:
        """Keep D's params for the next turn and start holding its blocks; log fields."""
        if not params.nixl or not params.nixl.has_remote_blocks:
            return {}
        entry = RetainedKV.build(conv, tenant, d.name, params.nixl, token_ids,
                                 time.monotonic() + self.cfg.entry_ttl_s, prompt_len)
        if not await self.store.aput(entry):
            # Not kept (store down or full): nobody will offer these blocks again.
            self.retention.ended(entry, False, ReleaseReason.DROPPED)
            return {}
        return self.retention.retained(entry)

    def _answer(self, inb: Inbound, resp: dict[str, Any], info: dict[str, Any],
                report: ReuseReport) -> Reply:
        clean_response(resp, inb.client_wants_token_ids)
        if not inb.stream:
            return Reply(200, json=resp, info=info, reuse=report)
        events = (chat_events if inb.endpoint is Endpoint.CHAT else completion_events)(
            resp, inb.include_usage)
        return Reply(200, stream=aiter_of(events), info=info, reuse=report)
