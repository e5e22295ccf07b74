"""Relaying an engine's stream to the client: decode and direct legs.

A stream reaches ``Relay`` only after its first event proved sane (``legs.open_stream``);
from then on garbage (an event that is not SSE, or whose data is neither ``[DONE]`` nor a JSON
object), a broken connection or an end without ``[DONE]`` (a Responses stream: without its
closing event) become an in-band error event, never a silently cut or garbled 200: the
garbled event itself is not relayed. Engine transfer params are taken out of every event.

A ``Capture`` (the decode leg's, when D's params come from the node's params feed) holds the
stream's last event (``[DONE]``, or a Responses stream's closing event) until the params for
this leg arrived and were retained, so a client that sends its next turn on that event finds
them; it is closed however the relay ends.

Threading model: the router's event loop; a relay is one async generator per answer.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

import msgspec

from kvtier.router.legs import Legs, StreamBroken
from kvtier.router.metrics import RouterMetrics
from kvtier.router.pool import InstanceState
from kvtier.router.requests import Endpoint
from kvtier.router.sse import (
    DONE,
    RESPONSE_END_TYPES,
    Garbage,
    clean_named_event,
    error_event,
    named_events,
    responses_error_event,
    strip_params,
)


class Capture(Protocol):
    """What a relay holds its last event for (decode.py's feed capture)."""

    async def finish(self) -> None:
        """The stream ended well: wait for this leg's params and retain them."""

    def close(self) -> None:
        """The relay is over, however it ended."""


class Relay:
    def __init__(self, legs: Legs, metrics: RouterMetrics) -> None:
        self.legs = legs
        self.metrics = metrics

    def __call__(self, endpoint: Endpoint, stream: AsyncIterator[bytes], inst: InstanceState,
                 capture: Capture | None = None) -> AsyncIterator[bytes]:
        """The client's stream of a leg on ``inst`` (Responses events, or chunks)."""
        if endpoint is Endpoint.RESPONSES:
            return self._responses(stream, inst, capture)
        return self._chunks(stream, inst, capture)

    async def _chunks(self, stream: AsyncIterator[bytes], inst: InstanceState,
                      capture: Capture | None) -> AsyncIterator[bytes]:
        inline = 0
        done = False

        def found(_params: dict[str, Any]) -> None:
            nonlocal inline
            inline += 1

        try:
            try:
                async for events in strip_params(stream, found):
                    bad = not_json(events)
                    if bad is not None:
                        raise Garbage(bad[:80].decode(errors="replace"))
                    if events.endswith(DONE):
                        done = True
                        if capture is not None:
                            events = events[:-len(DONE)]
                            if not events:
                                continue
                    yield events
            except Garbage as e:
                self.legs.midstream("decode", inst, f"not SSE: {e}")
                yield error_event("upstream decode sent a malformed stream")
                yield DONE
                return
            except StreamBroken as e:
                yield error_event(str(e))
                yield DONE
                return
            if not done:
                # The engine's stream ended without [DONE]: it died or was cut.
                self.legs.midstream("decode", inst, "stream ended without [DONE]")
                yield error_event("upstream decode ended the stream early")
                yield DONE
                return
            if inline:
                self.metrics.params_in_stream.inc(inline)
            if capture is not None:
                await capture.finish()
                yield DONE
        finally:
            await _closed(stream, capture)

    async def _responses(self, stream: AsyncIterator[bytes], inst: InstanceState,
                         capture: Capture | None) -> AsyncIterator[bytes]:
        """Named events; the stream ends with the response in its final state, no
        ``[DONE]``: that last event is what a capture holds."""
        last = None
        try:
            try:
                async for event in named_events(stream):
                    bad = not_json(event)
                    if bad is not None:
                        self.legs.midstream("decode", inst, f"not JSON: {bad[:80]!r}")
                        yield responses_error_event("upstream decode sent a malformed stream")
                        return
                    out, kind, _ = clean_named_event(event)
                    if kind in RESPONSE_END_TYPES:
                        last = out
                        continue
                    yield out
            except StreamBroken as e:
                yield responses_error_event(str(e))
                return
            if last is None:
                self.legs.midstream("decode", inst, "stream ended before the response did")
                yield responses_error_event("upstream decode ended the stream early")
                return
            if capture is not None:
                await capture.finish()
            yield last
        finally:
            await _closed(stream, capture)


_RAW = msgspec.json.Decoder(type=msgspec.Raw)  # checks JSON syntax, builds no objects


def not_json(events: bytes) -> bytes | None:
    """The first ``data:`` line of ``events`` whose data is neither ``[DONE]`` nor a JSON
    object (what an engine sends mid-stream when its stream turned to garbage), or None."""
    for line in events.split(b"\n"):
        if line[:5] == b"data:":
            data = line[5:].strip()
            if data == b"[DONE]":
                continue
            if data[:1] != b"{":
                return line
            try:
                _RAW.decode(data)
            except msgspec.DecodeError:
                return line
    return None


async def _closed(stream: AsyncIterator[bytes], capture: Capture | None) -> None:
    if capture is not None:
        capture.close()
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        with contextlib.suppress(Exception):
            await aclose()
