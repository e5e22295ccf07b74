"""The router learning each path's real cost (cost_learn) and pricing holds by decode pressure
(hold_pressure), against the fake engines (tests/fakes): what it records, what it logs, and
that both stay off unless configured."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvtier.ab.strategies import builtin
from kvtier.cost.model import CostModel
from kvtier.ids import ReusePath
from kvtier.router.app import create_app
from kvtier.router.config import RouterConfig
from kvtier.router.flow import Router
from tests.fakes.engine import BLOCK_SIZE, D_URL, IDX_URL, P_URL, FakeEngines

PROMPT = list(range(1, 11))
COST = {"kv_bytes_per_token": 2048, "prefill_b_s_per_token": 1e-3,
        "reads": {"dp_read": {"setup_s": 0.0, "bytes_per_s": 1e12},
                  "p2p": {"setup_s": 0.5, "bytes_per_s": 1e12}}}


def _router(fake: FakeEngines, **cfg: Any) -> Iterator[tuple[TestClient, Router]]:
    config = RouterConfig.model_validate({"prefill": [P_URL], "decode": [D_URL],
                                          "log_json": False, "block_size": BLOCK_SIZE, **cfg})
    with TestClient(create_app(config, transport=fake, health_checks=False)) as c:
        yield c, c.app.state.router  # type: ignore[attr-defined]


def test_the_router_times_each_path_and_logs_the_choice(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeEngines(lookup=[{"pod": "prefill-0", "matched_tokens": 4}])
    for c, r in _router(fake, indexer=IDX_URL, cost_model=COST, cost_learn=True):
        with caplog.at_level(logging.INFO, logger="kvtier.router"):
            for i in range(3):
                body = {"model": "tiny", "prompt": [i + 1, *PROMPT], "max_tokens": 3,
                        "conversation_id": f"c{i}"}
                assert c.post("/v1/completions", json=body).status_code == 200
        assert r.cost.estimator is not None and r.cost.estimator.seen == 3
        counts = {s.labels["path"]: s.value for mf in r.metrics.registry.collect()
                  if mf.name == "kvtier_router_cost_estimate_samples" for s in mf.samples}
        assert sum(counts.values()) == 3 and set(counts) <= {p.value for p in ReusePath}
        served = [rec for rec in caplog.records if rec.getMessage() == "served"]
        assert len(served) == 3
        for rec in served:  # the expected TTFT of every way it weighed, recompute included
            assert "none" in rec.expected_ms and rec.path in rec.expected_ms  # type: ignore[attr-defined]


def test_learning_and_pressure_are_off_unless_configured() -> None:
    cfg = RouterConfig.model_validate({
        "instances": [{"name": "p", "url": P_URL, "role": "prefill"},
                      {"name": "d", "url": D_URL, "role": "decode",
                       "lease": "tcp://127.0.0.1:1"}],
        "cost_model": COST, "retention": "adaptive"})
    r = Router(cfg)
    assert r.cost.estimator is None and r.retention.pressure is None
    assert isinstance(r.cost.decision_cost(), CostModel)
    on = Router(cfg.model_copy(update={"cost_learn": True, "hold_pressure": True}))
    assert on.cost.estimator is not None and on.retention.pressure is not None
    on.cost.prefill_leg(300, ReusePath.NONE, 0, 0.05)
    assert on.cost.estimator.seen == 1
    with pytest.raises(ValueError, match="cost_learn needs a cost_model"):
        RouterConfig.model_validate({"prefill": [P_URL], "decode": [D_URL], "cost_learn": True})


def test_tiered_adaptive_turns_learning_and_pressure_on() -> None:
    settings = builtin("tiered-adaptive").with_cost_model(CostModel.model_validate(COST)) \
        .router_settings()
    assert settings["cost_learn"] is True and settings["hold_pressure"] is True
    for name in ("recompute", "device-ttl", "host-p2p", "tiered"):
        assert "cost_learn" not in builtin(name).router_settings()
