"""deploy/overlays/cpu, run from its rendered manifests: a three-turn conversation through the
router Service reuses KV on turns 2 and 3, and every probe the manifests declare answers.

``kubectl kustomize deploy/overlays/cpu`` renders the overlay; ``tests.manifests.Cluster`` starts
each pod's containers (init containers first: each engine pod builds the tiny model) from the
rendered command, args, env and volumes as local processes, one network namespace per pod with
its own address and an ``/etc/hosts`` naming the pods and Services as cluster DNS would; its
docstring lists every difference from a cluster. Seven pods: prefill-0 and decode-0 (vLLM-CPU
with kvtier's connector), two router replicas, two indexer replicas, Redis.

The turns (``/v1/completions`` with token ids, see ``FIRST``) go to the router Service's two
pods in turn (A, B, A): turn 2 on the router that did not serve turn 1 finds the conversation
in the Redis store the replicas share. Turns 2 and 3 must say ``x-kvtier-reuse: dp_read...``
(or ``p2p``) and the prefill's
``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` must grow by more than
the recompute threshold (the previous answer: the prefill's own prefix cache holds the
previous prompt) and less than the prompt. Readiness probes gate the start; liveness (and
startup) probes must answer after the conversation.

Skipped only where ``ip netns add`` is refused (not root) or kubectl is missing, saying why.
Holds the machine-wide e2e lock (after releasing the shared stack pool's stack): these are
vLLM processes too.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvtier.ab.live.lock import e2e_lock
from tests.deploycheck import containers, render
from tests.e2e.pd import metric
from tests.manifests import Cluster
from tests.stillness import Stillness

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

OVERLAY = Path(__file__).resolve().parents[2] / "deploy" / "overlays" / "cpu"
READY_S = 300.0  # both engines start together on 2 cores: ~1-2 min measured
EXT = "vllm:prompt_tokens_by_source_total"
# The conversation, as token ids: turn 1 a 440-token prompt, each later turn the previous
# prompt, its answer's ids (`return_token_ids`) and 40 new ids. Text would not do here: the tiny
# model's random answers do not survive detokenizing and retokenizing, so a chat turn's prompt
# diverges from the decode node's KV where the answer starts, and what is left to read is the
# previous prompt, which the prefill has in its own prefix cache (measured: the router said
# `dp_read; tokens=416` and the prefill read 0 tokens over NIXL). With the ids, the prefill's
# own cache ends at the previous prompt and the answer (128 tokens, at least 96 of them
# block-aligned) is read from decode-0: more than the connector's kv_recompute_threshold (64).
FIRST, NEXT, ANSWER = 440, 40, 128


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def _place(cl: Cluster) -> None:
    """This machine's CPU tuning, as ``kvtier stack`` does it (kvtier.devstack.placement): each
    engine's model thread on a core of its own and NIXL's busy-polling progress thread at a low
    priority. A cluster gives each engine pod its own cores (the overlay requests one CPU per
    engine; Redis, routers and indexers request 0.9 more: more than these 2 cores, where
    a scheduler would leave a pod pending); without this, NixlConnector leaves both engines'
    model threads on the machine's last core (kvtier.devstack.placement's docstring)."""
    from kvtier.devstack.placement import place

    cpus = sorted(os.sched_getaffinity(0))
    for i, pod in enumerate(cl.of("engine")):
        for proc in pod.running.values():
            if proc.poll() is None:
                place(proc.pid, cpus[i % len(cpus)])


@pytest.fixture(scope="module")
def cluster(request, stack_pool) -> Iterator[Cluster]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on this machine: the overlay cannot be rendered")
    docs = render(OVERLAY)
    stack_pool.release()  # one vLLM stack on the machine at a time: this one, under the lock
    root = Path(tempfile.mkdtemp(prefix="kvtier-deploy-cpu-"))
    failed0 = request.session.testsfailed
    with e2e_lock():
        cl = Cluster(docs, root)
        try:
            try:
                cl.start()
            except RuntimeError as e:
                if "netns add" in str(e):
                    print(f"SKIPPED: network namespaces refused here: {e}", flush=True)
                    pytest.skip(f"ip netns refused on this machine: {e}")
                raise
            took = cl.wait_ready(READY_S)
            print(f"\n{len(cl.pods)} pods ready (readiness probes) in {took:.0f} s", flush=True)
            _place(cl)
        except BaseException:
            failed0 = -1  # keep the logs of a cluster that did not come up
            cl.stop()
            raise
        try:
            yield cl
        finally:
            cl.stop()
            if request.session.testsfailed == failed0:
                shutil.rmtree(root, ignore_errors=True)
            else:
                print(f"pods' files and logs kept in {root}", flush=True)


# A conversation whose checks fail is run once more (a new conversation) only when the
# machine stood still for at least this long during it (tests/stillness.py): a stopped VM
# lets the decode lease (30 s) and the router's prefill timeout (60 s) run out on the
# monotonic clock while nothing ran. Any other failure fails the test.
STILL_S = 10.0


def _conversation(cluster: Cluster, conversation: str, seed: int = 0,
                  ) -> tuple[list[tuple], float]:
    """Three turns through the two router pods in turn (A, B, A); each turn's (turn, the
    router's x-kvtier-reuse, prompt tokens the prefill read over NIXL, prompt tokens,
    seconds), and the seconds the machine stood still meanwhile. ``seed``: another seed gives
    other token ids (a second conversation the prefill's own cache knows nothing of)."""
    routers = [cluster.url(p) for p in cluster.of("router")]
    prefill = cluster.url(cluster.of("prefill")[0])
    assert len(routers) == 2, routers
    history: list[int] = []
    seen = []
    still = Stillness()
    with httpx.Client(timeout=300, trust_env=False) as http:  # a loaded 2-core machine
        for turn in range(3):
            prompt = history + _ids(seed + turn, FIRST if turn == 0 else NEXT)
            ext0 = metric(http, prefill, EXT, source="external_kv_transfer")
            t0 = time.perf_counter()
            r = http.post(routers[turn % 2] + "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": ANSWER, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True,
                "conversation_id": conversation})
            assert r.status_code == 200, r.text
            ext = metric(http, prefill, EXT, source="external_kv_transfer") - ext0
            reuse = r.headers.get("x-kvtier-reuse", "")
            seen.append((turn + 1, reuse, ext, len(prompt), round(time.perf_counter() - t0, 2)))
            print(f"turn {turn + 1} via router {'AB'[turn % 2]}: reuse {reuse!r}, prefill read "
                  f"{ext:.0f} of {len(prompt)} prompt tokens over NIXL "
                  f"(machine stood still {still.lost_s():.1f} s so far)", flush=True)
            history = prompt + r.json()["choices"][0]["token_ids"]
    return seen, still.lost_s()


def _check(seen: list[tuple], cluster: Cluster) -> None:
    assert seen[0][1].startswith("none"), seen
    for turn, reuse, ext, prompt, _ in seen[1:]:
        assert reuse.startswith(("dp_read", "p2p")), (turn, seen, _router_logs(cluster))
        # the previous answer at least (the prefill's own cache holds the previous prompt),
        # more than the recompute threshold
        assert ext >= 64, (turn, seen)
        assert ext < prompt, (turn, seen)


def test_three_turns_through_the_router_service_reuse_kv(cluster: Cluster) -> None:
    seen, lost = _conversation(cluster, "deploy-cpu-conversation")
    try:
        _check(seen, cluster)
    except AssertionError as e:
        if lost < STILL_S:
            raise
        print(f"the machine stood still {lost:.0f} s during this conversation (no CPU ran: "
              f"tests/stillness.py), its checks failed: {str(e)[:300]}; once more, as a new "
              "conversation", flush=True)
        seen, lost = _conversation(cluster, "deploy-cpu-conversation-2", seed=100)
        _check(seen, cluster)


def _router_logs(cl: Cluster) -> str:
    """The routers' own words (their log files stay on the machine that ran the test): each
    replica's warnings and served lines, which name each turn's take, plan and hold."""
    out = []
    for pod in cl.of("router"):
        lines = [ln for ln in cl.log_tail(pod, "router", 200_000).splitlines()
                 if "served" in ln or "WARNING" in ln.upper() or "ERROR" in ln.upper()]
        out.append(f"--- {pod.name}\n" + "\n".join(lines[-20:]))
    return "\n".join(out)


def test_every_probe_answers(cluster: Cluster) -> None:
    """Every probe the manifests declare passes as the kubelet judges it (``probe_fails``:
    ``failureThreshold`` attempts in a row must fail; a run on the 2-core VM saw Redis's exec probe, a
    ``redis-cli`` started through ``ip netns exec``, miss its 1 s timeout once)."""
    failed = []
    for pod in cluster.pods:
        for c in containers(pod.workload):
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind in c and cluster.probe_fails(pod, c, kind):
                    failed.append(f"{pod.name}/{c['name']} {kind}")
    assert failed == []
