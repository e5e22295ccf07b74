"""Decode-side leases: the table's deadlines and accounting, the wire, the ZMQ server."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvtier.tier.leases import LeaseCollector, LeaseMetricsServer, LeaseServer, LeaseTable
from kvtier.wire.leases import (
    LeaseReply,
    LeaseRequest,
    Op,
    ProtocolError,
    ReleaseReason,
    call,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture()
def clock():
    return Clock()


@pytest.fixture()
def table(clock):
    return LeaseTable(30.0, clock)


def test_grant_is_capped_by_the_ttl_and_takes_the_request_lease(table, clock):
    assert table.grant("a", 4, ttl_deadline=100 + 480) == 130.0
    assert table.grant("b", 2, ttl_deadline=110.0) == 110.0          # vLLM's TTL bounds it
    assert table.grant("c", 1, ttl_deadline=580.0, lease_s=5) == 105.0
    s = table.snapshot()
    assert (s["blocks_retained"], s["leases_held"], s["granted"]) == (7, 3, 3)
    assert table.take_updates() == {}  # a grant's deadline travels with the request itself


def test_renew_extends_up_to_the_bound_and_queues_the_new_deadline(table, clock):
    table.grant("a", 4, ttl_deadline=150.0)
    clock.t = 120.0
    st = table.renew(["a", "nobody"])
    assert st["a"].held and st["a"].deadline == 150.0 and st["a"].expires_in_s == 30.0
    assert not st["nobody"].held
    assert table.take_updates() == {"a": 150.0}
    clock.t = 125.0
    assert table.renew(["a"])["a"].deadline == 150.0  # already at the bound
    assert table.take_updates() == {}
    assert table.snapshot()["renewed"] == 1


def test_release_sets_the_deadline_now_and_cannot_be_renewed(table, clock):
    table.grant("a", 4, ttl_deadline=580.0)
    clock.t = 101.0
    assert not table.release(["a"], ReleaseReason.CLOSED)["a"].held
    assert table.take_updates() == {"a": 101.0}
    assert not table.renew(["a"])["a"].held
    assert not table.release(["a"], ReleaseReason.CLOSED)["a"].held  # counted once
    table.finished(["a"])
    s = table.snapshot()
    assert s["released"]["closed"] == 1 and s["expired"] == s["read"] == 0
    assert s["blocks_retained"] == 0


def test_finished_tells_read_from_expired(table, clock):
    table.grant("read", 2, ttl_deadline=580.0)
    table.grant("late", 3, ttl_deadline=580.0)
    clock.t = 110.0
    table.finished(["read", "unknown"])
    clock.t = 130.0
    table.finished(["late"])
    s = table.snapshot()
    assert (s["read"], s["expired"], s["leases_held"]) == (1, 1, 0)
    assert s["expiry_lag_s_total"] == s["expiry_lag_s_max"] == 0.0  # freed at its deadline


def test_expiry_lag_is_the_time_from_deadline_to_free(table, clock):
    """An engine slow to free an expired lease's blocks shows as lag (the node's own clock),
    reads and releases do not."""
    table.grant("slow", 2, ttl_deadline=580.0)      # deadline 130
    table.grant("slower", 2, ttl_deadline=580.0)    # deadline 130
    table.grant("read", 2, ttl_deadline=580.0)
    clock.t = 105.0
    table.finished(["read"])
    clock.t = 130.5
    table.finished(["slow"])
    clock.t = 133.0
    table.finished(["slower"])
    s = table.snapshot()
    assert (s["expired"], s["read"]) == (2, 1)
    assert s["expiry_lag_s_max"] == pytest.approx(3.0)
    assert s["expiry_lag_s_total"] == pytest.approx(3.5)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(LeaseCollector(table, "d0"))
    text = generate_latest(reg).decode()
    assert 'kvtier_decode_expiry_lag_seconds_max{pod="d0"} 3.0' in text
    assert 'kvtier_decode_expiry_lag_seconds_total{pod="d0"} 3.5' in text


def test_block_seconds_integrate_what_was_held(table, clock):
    table.grant("a", 4, ttl_deadline=580.0)
    clock.t = 110.0
    table.grant("b", 2, ttl_deadline=580.0)
    clock.t = 120.0
    table.finished(["a"])
    clock.t = 125.0
    assert table.snapshot()["block_seconds_held"] == pytest.approx(4 * 10 + 6 * 10 + 2 * 5)


def test_table_rejects_a_bad_default():
    with pytest.raises(ValueError, match="default_lease_s"):
        LeaseTable(0)


@pytest.mark.parametrize("raw, match", [
    (b"not json", "not JSON"),
    (b'{"v": 2, "op": "renew"}', "v=1"),
    (b'{"v": 1, "op": "steal"}', "unknown op"),
    (b'{"v": 1, "op": "renew", "request_ids": [3]}', "request_ids"),
    (b'{"v": 1, "op": "renew", "request_ids": ["a"], "lease_s": -1}', "lease_s"),
    (b'{"v": 1, "op": "renew", "request_ids": ["a"], "lease_s": true}', "lease_s"),
    (b'{"v": 1, "op": "release", "request_ids": ["a"], "reason": "boredom"}', "reason"),
])
def test_malformed_requests_are_refused_by_name(raw, match):
    with pytest.raises(ProtocolError, match=match):
        LeaseRequest.decode(raw)


def test_request_round_trip():
    req = LeaseRequest(Op.RELEASE, ("a", "b"), None, ReleaseReason.TRIMMED)
    assert LeaseRequest.decode(req.encode()) == req
    req = LeaseRequest(Op.RENEW, ("a",), 12.5)
    assert LeaseRequest.decode(req.encode()) == req


def test_server_over_zmq(table, clock):
    table.grant("a", 4, ttl_deadline=580.0)
    server = LeaseServer(table, "tcp://127.0.0.1:*")
    try:
        ep = server.endpoint
        clock.t = 110.0
        r = call(ep, LeaseRequest(Op.RENEW, ("a", "b"), 60.0))
        assert r.ok and r.leases["a"].held and r.leases["a"].deadline == 170.0
        assert not r.leases["b"].held
        r = call(ep, LeaseRequest(Op.STATS))
        assert r.ok and r.stats["leases_held"] == 1 and r.stats["renewed"] == 1
        r = call(ep, LeaseRequest(Op.RELEASE, ("a",), reason=ReleaseReason.MOVED))
        assert r.ok and table.take_updates() == {"a": 110.0}
        # a malformed request gets an error reply, and the server keeps serving
        import zmq

        s = zmq.Context.instance().socket(zmq.DEALER)
        s.connect(ep)
        s.send(b"garbage")
        assert s.poll(2000)
        bad = LeaseReply.decode(s.recv())
        s.close(0)
        assert not bad.ok and "not JSON" in (bad.error or "")
        assert call(ep, LeaseRequest(Op.STATS)).ok
    finally:
        server.close()


def test_call_times_out_on_a_silent_endpoint():
    from kvtier.runtime import free_ports

    (port,) = free_ports(1)
    with pytest.raises(TimeoutError, match="did not answer"):
        call(f"tcp://127.0.0.1:{port}", LeaseRequest(Op.STATS), timeout_s=0.2)


def test_metrics_expose_the_table(table, clock):
    from kvtier.runtime import free_ports

    table.grant("a", 4, ttl_deadline=580.0)
    table.release(["a"], ReleaseReason.DROPPED)
    table.idle_step_slowed()
    table.idle_step_slowed()
    (port,) = free_ports(1)
    srv = LeaseMetricsServer(table, "d0", port, host="127.0.0.1")
    try:
        text = generate_latest(srv.registry).decode()
    finally:
        srv.close()
    assert 'kvtier_decode_blocks_retained{pod="d0"} 4.0' in text
    assert 'kvtier_decode_leases_granted_total{pod="d0"} 1.0' in text
    assert 'kvtier_decode_leases_released_total{pod="d0",reason="dropped"} 1.0' in text
    assert 'kvtier_decode_idle_steps_slowed_total{pod="d0"} 2.0' in text
