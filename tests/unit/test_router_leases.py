"""The router's LeaseKeeper against a real lease server (in-process table, real ZMQ)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtier.ids import PodId
from kvtier.router.leases import LeaseKeeper, next_round
from kvtier.runtime import free_ports
from kvtier.tier.leases import LeaseServer, LeaseTable
from kvtier.wire.leases import ReleaseReason

D = PodId("decode-0")


@pytest.fixture()
def node():
    table = LeaseTable(30.0)
    server = LeaseServer(table, "tcp://127.0.0.1:*")
    yield table, server
    server.close()


def test_renewal_round_renews_tracked_and_reports_lost(node):
    table, server = node
    table.grant("a", 2, ttl_deadline=table.clock() + 480, lease_s=1.0)
    lost: list[tuple[str, str]] = []
    results: list[tuple[str, str]] = []
    keeper = LeaseKeeper({D: server.endpoint}, 20.0, on_lost=lambda p, r: lost.append((p, r)),
                         on_result=lambda op, res: results.append((op, res)))

    async def go():
        keeper.track(D, "a")
        keeper.track(D, "gone")  # never granted (or already read)
        await keeper.renew_all()
        await keeper.stop()

    asyncio.run(go())
    assert lost == [(D, "gone")]
    d = keeper.deadline(D, "a")
    assert d is not None and d > table.clock() + 15  # renewed to ~20 s
    assert table.snapshot()["renewed"] == 1 and results == [("renew", "ok")]


def test_hold_over_releases_and_release_is_counted(node):
    table, server = node
    for rid in ("short", "closed"):
        table.grant(rid, 1, ttl_deadline=table.clock() + 480)
    keeper = LeaseKeeper({D: server.endpoint}, 30.0)

    async def go():
        keeper.track(D, "short", hold_s=0.0)   # the adaptive policy chose not to hold it
        keeper.track(D, "closed")
        await keeper.release(D, ["closed"], ReleaseReason.CLOSED)
        await keeper.renew_all()
        await keeper.stop()

    asyncio.run(go())
    rel = table.snapshot()["released"]
    assert rel["closed"] == 1 and rel["moved"] == 1
    assert keeper.held(D) == 0


def test_a_dead_node_costs_one_timeout_and_no_exception():
    (port,) = free_ports(1)
    results: list[tuple[str, str]] = []
    keeper = LeaseKeeper({D: f"tcp://127.0.0.1:{port}"}, 30.0, timeout_s=0.2,
                         on_result=lambda op, res: results.append((op, res)))

    async def go():
        keeper.track(D, "a")
        await keeper.renew_all()
        await keeper.stop()

    asyncio.run(go())
    assert results == [("renew", "unavailable")]
    assert keeper.held(D) == 1  # kept: the node may come back within the lease


def test_bad_lease_is_refused():
    with pytest.raises(ValueError, match="lease_s"):
        LeaseKeeper({}, 0)


def test_rounds_keep_their_cadence_after_a_slow_one():
    # due at 1.0, ended at 1.9 (a node's timeout): the next is due at 2.0, not 2.9
    assert next_round(1.0, 1.9, 1.0) == 2.0
    assert next_round(1.0, 1.05, 1.0) == 2.0
    # a round that overran whole periods (a stalled loop) is followed at once, once
    assert next_round(1.0, 4.5, 1.0) == 4.5
    assert next_round(4.5, 4.6, 1.0) == 5.5


def test_a_dead_node_does_not_delay_another_nodes_renewal(node):
    table, server = node
    table.grant("a", 1, ttl_deadline=table.clock() + 480, lease_s=5.0)
    dead = PodId("decode-dead")
    (port,) = free_ports(1)
    # the dead node first: renewed one after the other, "a" would wait out its timeout
    keeper = LeaseKeeper({dead: f"tcp://127.0.0.1:{port}", D: server.endpoint}, 20.0,
                         timeout_s=3.0)
    renewed_at: list[float] = []

    async def go():
        keeper.track(dead, "x")
        keeper.track(D, "a")
        t0 = time.monotonic()
        task = asyncio.create_task(keeper.renew_all())
        while keeper.deadline(D, "a") is None:
            await asyncio.sleep(0.01)
        renewed_at.append(time.monotonic() - t0)
        await task
        await keeper.stop()

    asyncio.run(go())
    assert renewed_at[0] < 2.0, f"the live node was renewed after {renewed_at[0]:.1f} s"
    assert table.snapshot()["renewed"] == 1
