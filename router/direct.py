"""The direct leg: a whole request on one instance, no P/D split, no KV params.

Served for requests that need the prompt computed where they run (``Inbound.mode ==
"direct"``: n>1, batches, beam search, prompt logprobs, echo), and as the fallback of a P/D
leg whose retry policy ran out (``after``: ``Exhausted.RECOMPUTE`` recomputes here, on an
instance that has not failed this request yet; otherwise the leg's last error is raised).
Decode instances first (serving whole requests is their job), then prefills.

Threading model: as ``Router``: one event loop.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.ids import PodId, ReusePath
from kvtier.router.config import RouterConfig
from kvtier.router.legs import Legs, UpstreamError
from kvtier.router.metrics import RouterMetrics
from kvtier.router.pool import InstancePool
from kvtier.router.relay import Relay
from kvtier.router.reply import Reply, clean_response
from kvtier.router.requests import direct_body
from kvtier.router.retry import Attempts, Exhausted, Failure, RetryPolicy
from kvtier.router.turn import Turn, TurnLog
from kvtier.wire.reuse_headers import ReuseReport


class DirectLeg:
    def __init__(self, cfg: RouterConfig, pool: InstancePool, policy: RetryPolicy, legs: Legs,
                 metrics: RouterMetrics, relay: Relay) -> None:
        self.cfg = cfg
        self.pool = pool
        self.policy = policy
        self.legs = legs
        self.metrics = metrics
        self.relay = relay

    async def after(self, run: Attempts, turn: Turn, last: UpstreamError | None = None,
                    ) -> Reply:
        """``run`` (a leg of ``turn``) ended without an answer: do what its policy says."""
        p = run.policy
        if p.on_exhausted is Exhausted.RECOMPUTE:
            self.metrics.retries.labels(p.leg, Exhausted.RECOMPUTE).inc()
            return await self.serve(turn, reason=f"{p.leg}_failed", avoid=run.tried)
        raise last or UpstreamError(p.leg, None, Failure.NO_INSTANCE)

    async def serve(self, turn: Turn, reason: str, avoid: Iterable[PodId] = ()) -> Reply:
        """Serve the whole request on one instance; instances in ``avoid`` (they already
        failed this request) are skipped. The answer reports no reuse, and the outcome of the
        conversation's retained turn as far as the flow got."""
        inb = turn.inb
        run = Attempts(self.policy, avoid)
        turn.log = TurnLog(reuse="none", direct=reason)
        turn.report = ReuseReport(outcome=turn.report.outcome)
        self.metrics.reuse.labels(ReusePath.NONE).inc()
        last: UpstreamError | None = None
        for _ in run:
            inst = (self.pool.choose([d for d in self.pool.decode if d.healthy],
                                     exclude=run.tried)
                    or self.pool.choose(self.pool.decode + self.pool.prefill, exclude=run.tried))
            if inst is None:
                break
            body = direct_body(inb)
            turn.log.decode = inst.name
            try:
                if inb.stream:
                    stream = await self.legs.open_stream(inst, "direct", inb.endpoint.path,
                                                         body, turn.headers)
                    return Reply(200, stream=self.relay(inb.endpoint, stream, inst),
                                 log=turn.log, reuse=turn.report)
                resp = await self.legs.post_json(inst, "direct", inb.endpoint.path, body,
                                                 turn.headers, self.cfg.timeouts.decode_idle_s)
            except UpstreamError as e:
                last = e
                self.legs.retrying(run, inst, e)
                continue
            clean_response(resp, True)
            return Reply(200, json=resp, log=turn.log, reuse=turn.report)
        return await self.after(run, turn, last)
