from kvtier.transfer_params import KVTransferParams, NixlParams, RemoteKVSource

DECODE_RESPONSE = {
    "do_remote_prefill": False, "do_remote_decode": True, "remote_block_ids": [[1, 2, 3, 4]],
    "remote_engine_id": "e1", "remote_request_id": "r1", "remote_host": "127.0.0.1",
    "remote_port": 5600, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": 128,
    "remote_blocks_expiry_time": 1082.4, "transfer_mode": "pull", "future_field": {"x": 1},
}


def test_roundtrip_keeps_unknown_fields():
    p = KVTransferParams.from_wire(DECODE_RESPONSE)
    assert p is not None and p.nixl is not None and p.nixl.has_remote_blocks
    wire = p.to_wire()
    assert wire["future_field"] == {"x": 1}  # version skew degrades, not breaks
    assert wire["remote_block_ids"] == [[1, 2, 3, 4]]
    assert wire["kvtier_version"] == 1


def test_malformed_is_none_not_exception():
    assert KVTransferParams.from_wire(None) is None
    assert KVTransferParams.from_wire("x") is None
    assert KVTransferParams.from_wire({"remote_port": "not a port"}) is None
    assert KVTransferParams.from_wire({"remote_kv_source": {"pod": "p"}}) is None


def test_prefill_request_from_reuse_sets_directions():
    reuse = KVTransferParams.from_wire(DECODE_RESPONSE).nixl
    w = KVTransferParams.prefill_request(reuse=reuse).to_wire()
    assert w["do_remote_decode"] is True and w["do_remote_prefill"] is False
    assert w["remote_block_ids"] == [[1, 2, 3, 4]]
    fresh = KVTransferParams.prefill_request().to_wire()
    assert fresh["do_remote_decode"] is True and "remote_block_ids" not in fresh


def test_trim_to_verified_prefix():
    n = NixlParams.model_validate(DECODE_RESPONSE)
    t = n.trimmed(70, 32)
    assert t.remote_block_ids == [[1, 2]] and t.remote_num_tokens == 64
    assert n.trimmed(31, 32) is None


def test_remote_source_nested():
    src = RemoteKVSource(pod="prefill-1", host="127.0.0.1", port=7000, num_tokens=256, block_size=32)
    w = KVTransferParams.prefill_request(source=src).to_wire()
    back = KVTransferParams.from_wire(w)
    assert back.remote_kv_source == src
