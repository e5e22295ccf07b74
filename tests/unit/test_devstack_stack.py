"""LocalStack process handling with a stand-in server (the real vLLM path is e2e)."""

from __future__ import annotations

import sys
import textwrap

import pytest

import kvtier.devstack.spec as spec_mod
import kvtier.runtime as runtime
from kvtier.devstack.spec import StackSpec
from kvtier.devstack.stack import LocalStack, StackStartError

# A stand-in for the vLLM server: fails with "Address already in use" while a
# marker file is absent (and creates it), then serves /health on --port. In mode
# "engine-dies" the failing start lives on, never healthy (vLLM's API server
# outliving its dead engine core).
FAKE_SERVER = textwrap.dedent("""
    import http.server, os, sys, time
    marker = os.environ["FAKE_MARKER"]
    if os.environ.get("FAKE_MODE") == "hang-always":
        time.sleep(3600)
    if os.environ.get("FAKE_MODE") == "crash":
        print("ValueError: model is broken", flush=True); sys.exit(3)
    if not os.path.exists(marker):
        open(marker, "w").close()
        if os.environ.get("FAKE_MODE") == "hang":
            time.sleep(3600)  # alive, never ready
        if os.environ.get("FAKE_MODE") == "engine-dies":
            print("(EngineCore pid=1) ERROR EngineCore failed to start.", flush=True)
        print("OSError: [Errno 98] Address already " + "in use", flush=True)
        for _ in range(60): print("  traceback line", flush=True)
        if os.environ.get("FAKE_MODE") == "engine-dies":
            time.sleep(3600)
        sys.exit(1)
    port = int(sys.argv[sys.argv.index("--port") + 1])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


@pytest.fixture
def fake_server(monkeypatch, tmp_path):
    monkeypatch.setattr(spec_mod, "VLLM_SERVER_ARGV", [sys.executable, "-c", FAKE_SERVER])
    monkeypatch.setenv("KVTIER_DEVICE", "cpu")
    monkeypatch.setenv("FAKE_MARKER", str(tmp_path / "marker"))
    return tmp_path


def test_lost_port_race_restarts_with_fresh_ports_and_stops_cleanly(fake_server):
    stack = LocalStack(StackSpec(model="/m", prefill=1, decode=0), fake_server / "logs",
                       startup_timeout_s=30)
    with stack:
        assert [i.alive() for i in stack.instances] == [True]
        pid = stack.instances[0].proc.pid
    assert not stack.instances[0].alive()
    with pytest.raises(ProcessLookupError):
        import os
        os.kill(pid, 0)


def test_instances_stay_in_the_owners_session_each_in_a_process_group(fake_server):
    """One session (Linux weighs nice levels within a session only: the placement's demoted
    spinners must yield to the owner's other work), a process group each (stop() kills it)."""
    import os

    (fake_server / "marker").touch()  # the stand-in serves at once (no port race)
    with LocalStack(StackSpec(model="/m", prefill=1, decode=1), fake_server / "logs",
                    startup_timeout_s=30) as stack:
        pids = [i.proc.pid for i in stack.instances]
        assert [os.getsid(p) for p in pids] == [os.getsid(0)] * 2
        assert [os.getpgid(p) for p in pids] == pids


def test_a_crash_at_startup_raises_with_the_log_tail(fake_server, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "crash")
    stack = LocalStack(StackSpec(model="/m", prefill=1, decode=0), fake_server / "logs",
                       startup_timeout_s=30)
    with pytest.raises(StackStartError, match="model is broken"):
        stack.start()
    assert all(not i.alive() for i in stack.instances)


@pytest.mark.timeout(90)  # without the log check it would wait out the 600 s startup timeout
def test_engine_core_dying_of_a_taken_port_restarts_though_the_server_lives(fake_server,
                                                                            monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "engine-dies")
    stack = LocalStack(StackSpec(model="/m", prefill=1, decode=0), fake_server / "logs",
                       startup_timeout_s=600)
    with stack:
        assert [i.alive() for i in stack.instances] == [True]
    assert (fake_server / "marker").exists()  # the first start did fail


def test_a_fatal_log_line_fails_the_start_without_waiting(fake_server, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "engine-dies")
    (fake_server / "marker").unlink(missing_ok=True)
    stack = LocalStack(StackSpec(model="/m", prefill=1, decode=0, base_port=41200),
                       fake_server / "logs", startup_timeout_s=600)
    with pytest.raises(StackStartError, match="EngineCore failed to start"):
        stack.start()  # fixed ports: no restart, but no 600 s wait either
    assert all(not i.alive() for i in stack.instances)


# A program that starts a stack and waits, as `kvtier ab` or a user's script does.
OWNER = textwrap.dedent("""
    import sys, time, pathlib
    import kvtier.devstack.spec as spec_mod
    from kvtier.devstack.spec import StackSpec
    from kvtier.devstack.stack import LocalStack
    spec_mod.VLLM_SERVER_ARGV = [sys.executable, "-c", sys.argv[1]]
    out = pathlib.Path(sys.argv[2])
    stack = LocalStack(StackSpec(model="/m", prefill=1, decode=0), out / "logs",
                       startup_timeout_s=30)
    stack.start()
    (out / "server.pid").write_text(str(stack.instances[0].proc.pid))
    time.sleep(120)
""")


@pytest.mark.timeout(90)
def test_sigterm_to_the_owner_stops_its_servers(fake_server):
    import os
    import signal
    import subprocess
    import time

    (fake_server / "marker").touch()  # the stand-in serves at once
    owner = subprocess.Popen([sys.executable, "-c", OWNER, FAKE_SERVER, str(fake_server)])
    pid_file = fake_server / "server.pid"
    deadline = time.monotonic() + 60
    while not pid_file.exists() and owner.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pid_file.exists(), "the owner did not start its stack"
    server = int(pid_file.read_text())
    owner.send_signal(signal.SIGTERM)
    assert owner.wait(timeout=30) == 128 + signal.SIGTERM
    with pytest.raises(ProcessLookupError):
        os.kill(server, 0)  # gone, not left running


def test_sigterm_policy_unwinds_as_ctrl_c_and_exits_143():
    # One policy for every kvtier program: a command that stops in order on Ctrl-C
    # (`kvtier ab` reports the strategies it finished) does the same on `kill`, and a
    # program that catches nothing exits 128 + SIGTERM.
    import signal

    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        runtime.unwind_on_sigterm()
        with pytest.raises(KeyboardInterrupt) as caught:
            signal.raise_signal(signal.SIGTERM)
        assert isinstance(caught.value, SystemExit) and caught.value.code == 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, before)


def test_a_program_with_its_own_sigterm_handler_keeps_it(fake_server):
    import signal

    def mine(signum, frame):
        raise RuntimeError("the program's own handler")

    before = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, mine)
        (fake_server / "marker").touch()
        with LocalStack(StackSpec(model="/m", prefill=1, decode=0), fake_server / "logs",
                        startup_timeout_s=30):
            assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)


SLOW_SERVER = textwrap.dedent("""
    import http.server, os, sys, time
    with open(os.environ["FAKE_STARTS"], "a") as f:
        f.write(f"{time.monotonic()}\\n")
    time.sleep(1.5)  # profiling, graph capture...
    port = int(sys.argv[sys.argv.index("--port") + 1])
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


@pytest.mark.parametrize("one_at_a_time", [True, False])
def test_instances_start_one_at_a_time_when_asked(monkeypatch, tmp_path, one_at_a_time):
    """On a shared GPU each vLLM sizes its KV cache from the memory free while it profiles:
    the next instance starts once the one before it is ready."""
    monkeypatch.setattr(spec_mod, "VLLM_SERVER_ARGV", [sys.executable, "-c", SLOW_SERVER])
    monkeypatch.setenv("KVTIER_DEVICE", "cpu")
    monkeypatch.setenv("FAKE_STARTS", str(tmp_path / "starts"))
    spec = StackSpec(model="/m", prefill=1, decode=1, one_at_a_time=one_at_a_time,
                     cpu_placement="off")
    with LocalStack(spec, tmp_path / "logs", startup_timeout_s=60):
        first, second = sorted(map(float, (tmp_path / "starts").read_text().split()))
    if one_at_a_time:
        assert second - first >= 1.5
    else:
        assert second - first < 1.5


def test_one_at_a_time_is_the_default_on_cuda_only(monkeypatch):
    spec_mod.is_cpu_platform.cache_clear()
    try:
        monkeypatch.setenv("KVTIER_DEVICE", "cuda")
        assert StackSpec(model="/m").starts_one_at_a_time()
        assert not StackSpec(model="/m", one_at_a_time=False).starts_one_at_a_time()
        # a fixed KV cache size skips the profiling that a neighbour's start disturbs
        for args in (("--kv-cache-memory-bytes", "8000000000"),
                     ("--kv-cache-memory-bytes=8000000000",)):
            assert not StackSpec(model="/m", extra_args=args).starts_one_at_a_time()
        spec_mod.is_cpu_platform.cache_clear()
        monkeypatch.setenv("KVTIER_DEVICE", "cpu")
        assert not StackSpec(model="/m").starts_one_at_a_time()
    finally:
        spec_mod.is_cpu_platform.cache_clear()


@pytest.mark.timeout(60)
def test_an_instance_that_never_becomes_ready_gets_one_more_start(fake_server, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "hang")
    stack = LocalStack(StackSpec(model="/m", prefill=1, decode=0), fake_server / "logs",
                       startup_timeout_s=4)
    with stack:
        assert [i.alive() for i in stack.instances] == [True]
    assert (fake_server / "marker").exists()  # the first start did hang


@pytest.mark.timeout(60)
def test_a_second_hang_is_not_retried(fake_server, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "hang-always")
    stack = LocalStack(StackSpec(model="/m", prefill=1, decode=0), fake_server / "logs",
                       startup_timeout_s=3)
    with pytest.raises(StackStartError, match="not ready after 3s"):
        stack.start()
    assert all(not i.alive() for i in stack.instances)
