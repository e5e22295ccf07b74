"""The platform fact everything else stands on: two processes on 127.0.0.1
READ a registered DRAM buffer over NIXL/UCX and get the same bytes."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest

pytestmark = pytest.mark.integration

NBYTES = 8 << 20  # 8 MiB, several descriptors


def _target(conn) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    buf = np.random.default_rng(1234).integers(0, 256, NBYTES, dtype=np.uint8)
    reg = agent.get_reg_descs([(buf.ctypes.data, NBYTES, 0, "")], "DRAM")
    agent.register_memory(reg)
    # Four 2 MiB descriptors over the buffer.
    chunk = NBYTES // 4
    descs = [(buf.ctypes.data + i * chunk, chunk, 0) for i in range(4)]
    conn.send((agent.get_agent_metadata(), descs, buf.tobytes()[:64]))
    conn.poll(600) and conn.recv()  # keep the memory until the initiator is done
    agent.deregister_memory(reg)
    conn.close()


def _initiator(conn, result) -> None:
    import time

    from nixl._api import nixl_agent, nixl_agent_config

    meta, remote_descs, _ = conn.recv()
    agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
    dst = np.zeros(NBYTES, dtype=np.uint8)
    reg = agent.get_reg_descs([(dst.ctypes.data, NBYTES, 0, "")], "DRAM")
    agent.register_memory(reg)
    remote = agent.add_remote_agent(meta)
    chunk = NBYTES // 4
    local_descs = agent.get_xfer_descs([(dst.ctypes.data + i * chunk, chunk, 0) for i in range(4)], "DRAM")
    remote_xfer = agent.get_xfer_descs(remote_descs, "DRAM")
    handle = agent.initialize_xfer("READ", local_descs, remote_xfer, remote, b"done")
    state = agent.transfer(handle)
    deadline = time.monotonic() + 120
    while state not in ("DONE", "ERR") and time.monotonic() < deadline:
        state = agent.check_xfer_state(handle)
    result["state"] = state
    result["digest"] = bytes(np.frombuffer(dst.tobytes(), dtype=np.uint8)[:64])
    result["sum"] = int(dst.astype(np.uint64).sum())
    agent.release_xfer_handle(handle)
    agent.deregister_memory(reg)
    conn.send("done")


def test_two_processes_read_registered_buffer_over_nixl():
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    mgr = ctx.Manager()
    result = mgr.dict()
    target = ctx.Process(target=_target, args=(a,))
    target.start()
    # The initiator needs the target's metadata; relay through this process.
    c1, c2 = ctx.Pipe()
    init = ctx.Process(target=_initiator, args=(c2, result))
    init.start()
    try:
        # Never block forever on a child that died: poll with a deadline (generous: a spawned
        # child imports NIXL and UCX; on 2 loaded cores that took over 60 s once).
        assert b.poll(300), "target process sent no NIXL metadata"
        payload = b.recv()
        c1.send(payload)
        assert c1.poll(300), "initiator did not finish the READ"
        assert c1.recv() == "done"
    finally:
        b.send("release")
        for p in (init, target):
            p.join(30)
            if p.is_alive():
                p.kill()
    assert init.exitcode == 0 and target.exitcode == 0
    expected = np.random.default_rng(1234).integers(0, 256, NBYTES, dtype=np.uint8)
    assert result["state"] == "DONE"
    assert result["digest"] == payload[2] == expected.tobytes()[:64]
    assert result["sum"] == int(expected.astype(np.uint64).sum())
