"""Decode-side leases on a real 1P1D vLLM-CPU stack (KVTierNixlConnector, decode_lease_s).

Witness: vLLM's own ``vllm:kv_cache_usage_perc`` on the decode node (blocks in use; a freed
block does not count even while the prefix cache remembers it) and the connector's
``kvtier_decode_*`` metrics. Each turn is a hand-rolled P->D exchange whose decode leg asks
for its own lease (``kvtier_decode_lease_s`` in kv_transfer_params), so one stack serves
every case: a lease nobody renews frees the blocks after one lease (not vLLM's 480 s TTL),
renewals keep them past several leases, a release frees them within 2 s, and a next turn
whose params carry the released deadline is refused cleanly by the prefill (it declines the
read: an error answer, never KV from freed blocks), and the same turn without reuse equals a
recompute. (``kv_load_failure_policy: recompute`` would recompute in place, but in vLLM 0.32
a declined D->P read under that policy never answers: docs/FACTS.md.)
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from kvtier.configs import load_config_file
from kvtier.devstack.spec import StackSpec
from kvtier.transfer_params import KVTransferParams, NixlParams
from kvtier.wire.leases import (
    PARAM_KEY,
    RETAIN_KEY,
    LeaseRequest,
    Op,
    ReleaseReason,
    call,
)
from tests.e2e.pd import complete, metric, reset_prefix_cache

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

CONFIG = load_config_file("nixl-bidirectional-lease")
OFFSET = CONFIG["kv_connector_extra_config"]["lease_port_offset"]
USAGE = "vllm:kv_cache_usage_perc"


@pytest.fixture(scope="module")
def stack(stack_pool, tiny_model):
    return stack_pool.get(StackSpec(model=tiny_model, prefill=1, decode=1,
                                    kv_transfer_config=CONFIG))


@pytest.fixture()
def http():
    with httpx.Client(timeout=120) as c:
        yield c


def _endpoints(stack) -> tuple[str, str]:
    port = stack.decode[0].spec.side_channel_port + OFFSET
    return f"tcp://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"


def _turn(http, stack, model, prompt, lease_s: float) -> dict:
    """Prefill on P, decode on D under a lease of ``lease_s``; D's returned params."""
    P, D = stack.prefill[0].url, stack.decode[0].url
    pre = complete(http, P, model, prompt, 1, KVTransferParams.prefill_request().to_wire())
    dec = complete(http, D, model, prompt, 16,
                   {**pre["kv_transfer_params"], PARAM_KEY: lease_s})
    kvp = dec["kv_transfer_params"]
    assert kvp["do_remote_decode"] and kvp["remote_block_ids"], kvp
    return {"params": kvp, "ids": prompt + dec["choices"][0]["token_ids"]}


def _wait(cond, within_s: float, step: float = 0.1) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(step)
    return None


def _idle(http, stack) -> None:
    D = stack.decode[0].url
    assert _wait(lambda: metric(http, D, USAGE) == 0, 30) is not None, \
        "decode node still holds blocks from an earlier test"


def _prompt(seed: int, n: int = 600) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def test_unrenewed_lease_frees_blocks_after_one_lease(http, stack, tiny_model):
    D = stack.decode[0].url
    ctl, mets = _endpoints(stack)
    _idle(http, stack)
    exp0 = metric(http, mets, "kvtier_decode_leases_expired_total")
    t0 = time.monotonic()
    _turn(http, stack, tiny_model, _prompt(1), lease_s=3)
    assert metric(http, D, USAGE) > 0, "the finished turn's blocks are retained"
    assert metric(http, mets, "kvtier_decode_blocks_retained") > 0
    freed = _wait(lambda: metric(http, D, USAGE) == 0, 20)
    assert freed is not None, "an unrenewed 3 s lease kept its blocks for 20 s"
    took = time.monotonic() - t0
    assert took >= 2.5, f"blocks freed after {took:.1f} s, before the lease ran out"
    assert metric(http, mets, "kvtier_decode_leases_expired_total") == exp0 + 1
    assert call(ctl, LeaseRequest(Op.STATS)).stats["leases_held"] == 0


def test_a_turn_asked_not_to_be_retained_keeps_nothing(http, stack, tiny_model):
    """``kvtier_decode_retain: false`` (the router would release the turn at once): D frees the
    turn's blocks when it finishes, names none in its params, grants no lease, and serves
    the same answer."""
    P, D = stack.prefill[0].url, stack.decode[0].url
    ctl, mets = _endpoints(stack)
    _idle(http, stack)
    n0 = metric(http, mets, "kvtier_decode_turns_not_retained_total")
    g0 = metric(http, mets, "kvtier_decode_leases_granted_total")
    prompt = _prompt(4)
    pre = complete(http, P, tiny_model, prompt, 1, KVTransferParams.prefill_request().to_wire())
    dec = complete(http, D, tiny_model, prompt, 16,
                   {**pre["kv_transfer_params"], RETAIN_KEY: False})
    kvp = dec["kv_transfer_params"]
    assert not kvp.get("remote_block_ids") and not kvp.get("remote_num_tokens"), kvp
    assert not NixlParams.model_validate(kvp).has_remote_blocks
    assert _wait(lambda: metric(http, D, USAGE) == 0, 2, step=0.05) is not None, \
        "a turn asked not to be retained still holds blocks"
    assert metric(http, mets, "kvtier_decode_turns_not_retained_total") == n0 + 1
    assert metric(http, mets, "kvtier_decode_leases_granted_total") == g0
    assert call(ctl, LeaseRequest(Op.STATS)).stats["leases_held"] == 0
    # the same turn retained: same tokens (keeping nothing changes no answer)
    kept = _turn(http, stack, tiny_model, prompt, lease_s=3)
    assert kept["ids"] == prompt + dec["choices"][0]["token_ids"]
    release = LeaseRequest(Op.RELEASE, (kept["params"]["remote_request_id"],),
                           reason=ReleaseReason.CLOSED)
    assert call(ctl, release).ok


def test_a_node_retaining_a_turn_slows_only_its_empty_steps(http, stack, tiny_model):
    """While D only retains a turn, vLLM's engine keeps stepping (to learn of reads and
    deadlines); each such empty step waits ``retained_idle_step_ms`` (5 ms on the CPU) so the
    node does not take ~0.45 of a core from the prefill. Witness: the counter moves while a
    turn is retained and stands still once it is released and D is idle."""
    ctl, mets = _endpoints(stack)
    _idle(http, stack)
    kept = _turn(http, stack, tiny_model, _prompt(5), lease_s=30)
    n0 = metric(http, mets, "kvtier_decode_idle_steps_slowed_total")
    time.sleep(1.0)
    n1 = metric(http, mets, "kvtier_decode_idle_steps_slowed_total")
    assert n1 > n0, "a node retaining a turn did not slow its empty steps"
    release = LeaseRequest(Op.RELEASE, (kept["params"]["remote_request_id"],),
                           reason=ReleaseReason.CLOSED)
    assert call(ctl, release).ok
    _idle(http, stack)
    n2 = metric(http, mets, "kvtier_decode_idle_steps_slowed_total")
    time.sleep(0.5)
    assert metric(http, mets, "kvtier_decode_idle_steps_slowed_total") == n2, \
        "an idle node with nothing retained still steps"


def test_renewed_lease_outlives_several_leases_and_release_frees_within_2s(http, stack,
                                                                          tiny_model):
    D = stack.decode[0].url
    ctl, mets = _endpoints(stack)
    _idle(http, stack)
    rel0 = metric(http, mets, "kvtier_decode_leases_released_total", reason="closed")
    turn = _turn(http, stack, tiny_model, _prompt(2), lease_s=3)
    rid = turn["params"]["remote_request_id"]
    t0 = time.monotonic()
    while time.monotonic() - t0 < 9:  # three leases
        r = call(ctl, LeaseRequest(Op.RENEW, (rid,), 3.0))
        assert r.ok and r.leases[rid].held, r
        time.sleep(1.0)
    assert metric(http, D, USAGE) > 0, "a renewed lease lost its blocks"
    assert metric(http, mets, "kvtier_decode_leases_renewed_total") >= 8
    t1 = time.monotonic()
    r = call(ctl, LeaseRequest(Op.RELEASE, (rid,), reason=ReleaseReason.CLOSED))
    assert r.ok and not r.leases[rid].held
    freed = _wait(lambda: metric(http, D, USAGE) == 0, 10, step=0.05)
    assert freed is not None and time.monotonic() - t1 <= 2.0, \
        f"released blocks still held after {time.monotonic() - t1:.1f} s"
    assert metric(http, mets, "kvtier_decode_leases_released_total", reason="closed") == rel0 + 1
    assert not call(ctl, LeaseRequest(Op.RENEW, (rid,))).leases[rid].held


def test_a_read_racing_a_release_is_declined_and_the_turn_recomputes(http, stack, tiny_model):
    P = stack.prefill[0].url
    ctl, _ = _endpoints(stack)
    _idle(http, stack)
    turn = _turn(http, stack, tiny_model, _prompt(3), lease_s=30)
    rid = turn["params"]["remote_request_id"]
    r = call(ctl, LeaseRequest(Op.RELEASE, (rid,), reason=ReleaseReason.MOVED))
    nxt = turn["ids"] + _prompt(4, 40)
    reset_prefix_cache(http, P)
    ref = complete(http, P, tiny_model, nxt, 16)["choices"][0]["token_ids"]
    reset_prefix_cache(http, P)
    # A router hands the prefill the deadline the lease server answered (the release time):
    # the prefill declines the read instead of reading freed blocks.
    reuse = NixlParams.model_validate({**turn["params"],
                                       "remote_blocks_expiry_time": r.leases[rid].deadline})
    ext0 = metric(http, P, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    declined0 = metric(http, P, "vllm:nixl_num_kv_expired_reqs_total")
    body = {"model": tiny_model, "prompt": nxt, "max_tokens": 1, "temperature": 0,
            "return_token_ids": True}
    pre = http.post(P + "/v1/completions", json={
        **body, "kv_transfer_params": KVTransferParams.prefill_request(reuse=reuse).to_wire()})
    assert pre.status_code >= 500, f"a read of released blocks was answered: {pre.text[:300]}"
    assert metric(http, P, "vllm:prompt_tokens_by_source_total",
                  source="external_kv_transfer") == ext0, "read released blocks"
    again = http.post(P + "/v1/completions", json={
        **body, "kv_transfer_params": KVTransferParams.prefill_request().to_wire()})
    assert again.status_code == 200, again.text
    assert again.json()["choices"][0]["token_ids"][:1] == ref[:1]
    # counted: vLLM's own counter of reads declined for an expired deadline
    assert _wait(lambda: metric(http, P, "vllm:nixl_num_kv_expired_reqs_total") > declined0, 15)
