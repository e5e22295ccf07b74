import argparse
import json

import pytest

import kvtier.devstack.platform as stack_mod
from kvtier.configs import CONFIG_DIR, load_config_file
from kvtier.devstack.cli import parse_cpus
from kvtier.devstack.spec import PORTS_PER_INSTANCE, StackSpec
from kvtier.ids import Role


def test_instances_get_distinct_ports_roles_and_cores():
    spec = StackSpec(model="/m", prefill=2, decode=1, kv_transfer_config={"kv_connector": "X"})
    inst = spec.instances()
    assert [i.role for i in inst] == [Role.PREFILL, Role.PREFILL, Role.DECODE]
    assert [i.name for i in inst] == ["prefill-0", "prefill-1", "decode-0"]
    ports = [p for i in inst for p in (i.http_port, i.side_channel_port, i.events_port, i.replay_port,
                                       i.tier_events_port, i.tier_replay_port, i.tier_p2p_port,
                                       i.tier_metrics_port)]
    assert len(ports) == len(set(ports)) == PORTS_PER_INSTANCE * 3


def test_instances_take_the_stacks_cores_in_turn(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    spec = StackSpec(model="/m", prefill=1, decode=2)
    assert [i.cpu_bind for i in spec.instances()] == ["0", "1", "2"]
    spec = StackSpec(model="/m", prefill=1, decode=2, cpus=(3, 1))
    assert [i.cpu_bind for i in spec.instances()] == ["3", "1", "3"]
    assert spec.instances()[2].env()["VLLM_CPU_OMP_THREADS_BIND"] == "3"


def test_stack_up_cpus_parse_and_refuse_cores_out_of_reach(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert parse_cpus("1") == (1,)
    assert parse_cpus("3,0-1") == (3, 0, 1)
    for bad in ("4", "x", "", "1,"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_cpus(bad)


def test_base_port_is_consecutive():
    inst = StackSpec(model="/m", prefill=1, decode=1, base_port=9000).instances()
    assert inst[0].http_port == 9000 and inst[1].http_port == 9000 + PORTS_PER_INSTANCE


def test_num_blocks_sets_the_kv_capacity_and_a_later_override_wins():
    plain = StackSpec(model="/m").instances()[0].argv()
    assert "--num-gpu-blocks-override" not in plain
    argv = StackSpec(model="/m", num_blocks=2048).instances()[0].argv()
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "2048"
    # argparse keeps the last: an extra argument (a regime's per-role capacity) wins
    argv = StackSpec(model="/m", num_blocks=2048,
                     extra_args=("--num-gpu-blocks-override", "160")).instances()[0].argv()
    assert argv[-2:] == ["--num-gpu-blocks-override", "160"]
    assert argv.index("--num-gpu-blocks-override") < len(argv) - 2
    with pytest.raises(ValueError):
        StackSpec(model="/m", num_blocks=0)


def test_argv_and_env_carry_events_nixl_and_transfer_config(monkeypatch):
    monkeypatch.setenv("KVTIER_DEVICE", "cpu")
    cfg = load_config_file("nixl-bidirectional")
    i = StackSpec(model="/m", kv_transfer_config=cfg).instances()[0]
    argv = i.argv()
    assert "--enable-prefix-caching" in argv
    events = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert events["endpoint"] == f"tcp://*:{i.events_port}"
    assert events["replay_endpoint"] == f"tcp://*:{i.replay_port}"
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == cfg
    assert argv[argv.index("--dtype") + 1] == stack_mod.cpu_dtype()
    env = i.env()
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(i.side_channel_port)
    assert env["KVTIER_P2P_PORT"] == str(i.tier_p2p_port)
    assert env["KVTIER_METRICS_PORT"] == str(i.tier_metrics_port)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == i.cpu_bind


def test_empty_stack_rejected():
    with pytest.raises(ValueError):
        StackSpec(model="/m", prefill=0, decode=0).instances()


def test_unknown_config_names_the_known_ones():
    with pytest.raises(FileNotFoundError, match="nixl-bidirectional"):
        load_config_file("nope")


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.json")), ids=lambda p: p.name)
def test_every_shipped_config_is_valid_json_with_a_connector(path):
    cfg = json.loads(path.read_text())
    if "kv_connector" in cfg:  # kv-transfer-configs
        assert cfg.get("kv_role") in {"kv_both", "kv_producer", "kv_consumer"}


def test_cpu_dtype_follows_the_cpu_and_the_override(monkeypatch):
    assert stack_mod.dtype_for_flags({"avx512f", "amx_tile", "avx512_bf16"}) == "float16"  # SIGILL
    assert stack_mod.dtype_for_flags({"avx512f", "avx512_bf16"}) == "bfloat16"
    assert stack_mod.dtype_for_flags({"avx2"}) == "float32"
    stack_mod.cpu_dtype.cache_clear()
    try:
        monkeypatch.setenv("KVTIER_CPU_DTYPE", "float32")
        assert stack_mod.cpu_dtype() == "float32"
        monkeypatch.setenv("KVTIER_DEVICE", "cpu")
        assert stack_mod.kv_dtype_bytes() == 4
        stack_mod.cpu_dtype.cache_clear()
        monkeypatch.setenv("KVTIER_CPU_DTYPE", "fp8")
        with pytest.raises(ValueError, match="KVTIER_CPU_DTYPE"):
            stack_mod.cpu_dtype()
    finally:
        stack_mod.cpu_dtype.cache_clear()


def test_free_ports_lie_below_the_ephemeral_range_and_are_bindable(tmp_path, monkeypatch):
    # Outgoing connections take source ports inside the ephemeral range; a listener port
    # picked there can be taken between the probe and vLLM's bind.
    import socket

    import kvtier.runtime as stack

    rng = tmp_path / "ip_local_port_range"
    rng.write_text("40000\t60999\n")
    monkeypatch.setattr(stack, "_EPHEMERAL_RANGE", rng)
    ports = stack.free_ports(16)
    assert len(set(ports)) == 16
    assert all(stack._LOW_PORT_FLOOR <= p < 40000 for p in ports)
    with socket.socket() as s:
        s.bind(("0.0.0.0", ports[0]))  # free: nothing holds it


def test_free_ports_skip_a_taken_port_and_fall_back_without_room(tmp_path, monkeypatch):
    import socket

    import kvtier.runtime as stack

    rng = tmp_path / "ip_local_port_range"
    rng.write_text(f"{stack._LOW_PORT_FLOOR + 2} 60999\n")  # room for two low ports only
    monkeypatch.setattr(stack, "_EPHEMERAL_RANGE", rng)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", stack._LOW_PORT_FLOOR))
        taken.listen()
        ports = stack.free_ports(4)  # needs more room than there is: the OS picks
        assert len(set(ports)) == 4 and stack._LOW_PORT_FLOOR not in ports
        assert not stack._bindable(stack._LOW_PORT_FLOOR)
