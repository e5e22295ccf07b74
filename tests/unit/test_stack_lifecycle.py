"""LocalStack process handling with a stand-in server (the real vLLM path is e2e)."""

from __future__ import annotations

import sys
import textwrap

import pytest

import kvtier.stack as stack_mod
from kvtier.stack import LocalStack, StackSpec, StackStartError

# A stand-in for the vLLM server: fails with "Address already in use" while a
# marker file is absent (and creates it), then serves /health on --port.
FAKE_SERVER = textwrap.dedent("""
    import http.server, os, sys
    marker = os.environ["FAKE_MARKER"]
    if os.environ.get("FAKE_MODE") == "crash":
        print("ValueError: model is broken", flush=True); sys.exit(3)
    if not os.path.exists(marker):
        open(marker, "w").close()
        print("OSError: [Errno 98] Address already " + "in use", flush=True)
        for _ in range(60): print("  traceback line", flush=True)
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
    monkeypatch.setattr(stack_mod, "VLLM_SERVER_ARGV", [sys.executable, "-c", FAKE_SERVER])
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


def test_a_crash_at_startup_raises_with_the_log_tail(fake_server, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "crash")
    stack = LocalStack(StackSpec(model="/m", prefill=1, decode=0), fake_server / "logs",
                       startup_timeout_s=30)
    with pytest.raises(StackStartError, match="model is broken"):
        stack.start()
    assert all(not i.alive() for i in stack.instances)
