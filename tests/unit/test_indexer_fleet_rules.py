"""Fleet rules without sockets: stream numbering and merging, source choice with loads and health."""

from __future__ import annotations

import pytest

from kvtier.ids import PodId, Tier
from kvtier.indexer.config import IndexerConfig, PodSpec, number_streams, pod_of
from kvtier.indexer.select import choose_source, matches, merge_streams

BS = 4
G, C = Tier.GPU, Tier.CPU
ADDR = {"a": ("10.0.0.1", 7001), "b": ("10.0.0.2", 7002), "c": ("10.0.0.3", 7003),
        "t": ("10.0.0.9", 7009)}


def choose(merged, target="t", min_delta=1, offered=lambda p: True, loads=None):
    return choose_source(merged, BS, None if target is None else PodId(target), min_delta,
                         lambda p: ADDR.get(p), offered, loads)


# -- config: several streams per pod -------------------------------------------------------

def test_same_name_twice_is_a_second_stream_of_that_pod():
    cfg = IndexerConfig(pods=(PodSpec.parse("d=tcp://h1:1,replay=tcp://h1:2"),
                              PodSpec.parse("d=tcp://h1:3,replay=tcp://h1:4,p2p=h1:7100"),
                              PodSpec.parse("d=tcp://h1:5,stream=rank1"),
                              PodSpec.parse("e=tcp://h2:1")))
    assert [p.stream_id for p in cfg.pods] == ["d", "d#1", "d#rank1", "e"]
    # the pod's p2p address, named by one stream, holds for all of them
    assert {p.p2p for p in cfg.pods if p.name == "d"} == {"h1:7100"}
    assert list(cfg.pods_by_name()) == ["d", "e"]
    assert all(pod_of(p.stream_id) == p.name for p in cfg.pods)


@pytest.mark.parametrize("specs,needle", [
    (["d=tcp://h:1", "d=tcp://h:1"], "twice"),
    (["d=tcp://h:1,stream=x", "d=tcp://h:2,stream=x"], "duplicate stream"),
    (["d=tcp://h:1,p2p=h:1", "d=tcp://h:2,p2p=h:2"], "disagree on p2p"),
    (["d=tcp://h:1,model=a", "d=tcp://h:2,model=b"], "disagree on model"),
    (["d=tcp://h:1,stream=a#b"], "stream name"),
])
def test_inconsistent_streams_are_refused(specs, needle):
    with pytest.raises(ValueError, match=needle):
        IndexerConfig(pods=tuple(PodSpec.parse(s) for s in specs))


def test_a_stream_added_later_is_numbered_after_the_running_ones():
    running = number_streams([PodSpec.parse("d=tcp://h:1"), PodSpec.parse("d=tcp://h:2")])
    (new,) = number_streams([PodSpec.parse("d=tcp://h:3")], running)
    assert new.stream_id == "d#2"


def test_peer_hosts_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVT_TEST_HOST", "10.1.2.3")
    s = PodSpec.parse("p=tcp://${KVT_TEST_HOST}:5557,p2p=${KVT_TEST_HOST}:7100")
    assert s.events == "tcp://10.1.2.3:5557" and s.p2p_host_port == ("10.1.2.3", 7100)
    s = PodSpec.model_validate({"name": "p", "events": "tcp://${KVT_TEST_HOST}:1"})
    assert s.events == "tcp://10.1.2.3:1"
    monkeypatch.delenv("KVT_TEST_HOST")
    with pytest.raises(ValueError, match="KVT_TEST_HOST is not set"):
        PodSpec.parse("p=tcp://${KVT_TEST_HOST}:5557")


def test_stale_after_is_validated():
    assert IndexerConfig().stale_after_s == 10.0
    with pytest.raises(ValueError):
        IndexerConfig(stale_after_s=0)


# -- merging ------------------------------------------------------------------------------

def test_streams_merge_per_pod_and_tier():
    found = {("d", G): 5, ("d#1", C): 7, ("d#rank1", G): 6, ("e", C): 2}
    merged = merge_streams(found)
    assert merged == {("d", G): 6, ("d", C): 7, ("e", C): 2}
    assert [(m.pod, m.tier, m.matched_tokens) for m in matches(merged, BS)] == [
        ("d", "CPU", 28), ("d", "GPU", 24), ("e", "CPU", 8)]


# -- source choice ------------------------------------------------------------------------

def test_target_is_never_its_own_source_and_delta_counts_all_its_tiers():
    merged = merge_streams({("t", G): 3, ("t#cpu", C): 9, ("a", C): 8})
    c = choose(merged)
    # the target's own host tier (9 blocks) is longest, but it is the target
    assert c.source is None and c.target_matched_tokens == 36 and c.delta == -4
    merged = merge_streams({("t", G): 3, ("t#cpu", C): 4, ("a", C): 8})
    c = choose(merged)
    assert c.source.pod == "a" and c.target_matched_tokens == 16 and c.delta == 16


def test_only_cpu_copies_with_an_address_and_enough_delta():
    assert choose({("a", G): 9}).source is None
    assert choose({("x", C): 9}).source is None          # no p2p address known
    c = choose({("a", C): 3, ("t", G): 2}, min_delta=5)
    assert c.source is None and c.delta == 4
    assert choose({("a", C): 3, ("t", G): 2}, min_delta=4).source.pod == "a"


def test_least_loaded_among_those_within_one_block_of_the_best():
    merged = {("a", C): 10, ("b", C): 9, ("c", C): 8}
    assert choose(merged).source.pod == "a"                               # no loads: longest
    assert choose(merged, loads={"a": 5, "b": 1}).source.pod == "b"       # within one block
    assert choose(merged, loads={"a": 5, "b": 5, "c": 0}).source.pod == "a"  # c is 2 behind
    c = choose(merged, loads={"a": 2, "b": 1})
    assert (c.source.pod, c.source.matched_tokens, c.delta) == ("b", 36, 36)
    # equal load and length: by name, whatever the input order
    assert choose({("b", C): 4, ("a", C): 4}).source.pod == "a"
    assert choose({("a", C): 4, ("b", C): 4}).source.pod == "a"


def test_stale_pods_are_not_offered():
    merged = {("a", C): 10, ("b", C): 6}
    c = choose(merged, offered=lambda p: p != "a")
    assert c.source.pod == "b"
    assert choose(merged, offered=lambda p: False).source is None


def test_no_target_means_a_target_that_holds_nothing():
    c = choose({("a", C): 3, ("t", C): 5}, target=None)
    assert c.source.pod == "t" and c.target_matched_tokens == 0 and c.delta == 20


def test_cli_flags_stale_after_and_repeated_pods():
    import argparse

    from kvtier.indexer import cli

    ap = argparse.ArgumentParser()
    cli.register(ap.add_subparsers())
    args = ap.parse_args(["indexer", "--stale-after", "2.5", "--pod", "d=tcp://h:1",
                          "--pod", "d=tcp://h:2,p2p=h:7100,stream=host"])
    cfg = cli.build_config(args)
    assert cfg.stale_after_s == 2.5
    assert [(p.stream_id, p.p2p) for p in cfg.pods] == [("d", "h:7100"), ("d#host", "h:7100")]
    with pytest.raises(ValueError):
        cli.build_config(ap.parse_args(["indexer", "--stale-after", "0"]))
