"""One-off live checks under one hold of the e2e lock (not CI):
A. tiered-adaptive as deployed (KVTierNixlConnector + kvtier-peer in a MultiConnector; renew, no
   cost model) on the e2e short trace -- needs KVTierNixlConnector registered with vLLM
   (here via PYTHONPATH=/tmp/abfix sitecustomize, standing in for the connectors/ fix);
B. the same with cost-tiny.json (retention: adaptive, host copy on) on the hold trace."""
import json
import sys
from pathlib import Path

from kvtier.ab.live.common import resolve_model
from kvtier.ab.live.lock import e2e_lock
from kvtier.ab.live.runner import MEASUREMENT, RunOptions, run_strategy
from kvtier.ab.report import write_report
from kvtier.ab.strategies import builtin
from kvtier.ab.traces import ConversationSpec, Trace, TurnSpec
from kvtier.cost.config import resolve_config_path
from kvtier.cost.model import CostModel
from kvtier.devstack.stack import LocalStack

out = Path(sys.argv[1])
model = str(resolve_model("tiny"))
def provider(spec, d):
    return LocalStack(spec, d)
with e2e_lock():
    print("locked", flush=True)
    # A
    short = Trace("e2e-short", 4096, [ConversationSpec(f"c{k}", 0.3 * k, 100 + k,
                  [TurnSpec(200, 16, 0.0), TurnSpec(96, 16, 0.5), TurnSpec(64, 16, 0.5)]) for k in range(2)])
    opts = RunOptions(model=model, kv_bytes_per_token=2048, log_dir=out / "logs-a", progress=False,
                      sample_interval_s=0.2)
    a = run_strategy(builtin("tiered-adaptive"), short, opts, stack_provider=provider)
    print("A turns", len(a.turns), [t.error[:100] for t in a.turns if not t.ok])
    print("A follow", [(t.reuse_path, t.reused_tokens, t.hold_s, t.hold_basis) for t in a.follow_ups])
    print("A block-s", a.device_block_seconds(), a.meta.get("device_blocks_source"),
          "host peak", max(s.host_bytes_held for s in a.memory))
    ok_a = (len(a.turns) == 6 and all(t.ok for t in a.turns)
            and all(t.reuse_path == "dp_read" and t.reused_tokens >= 192 for t in a.follow_ups)
            and a.device_block_seconds() > 0)
    print("A ok", ok_a, flush=True)
    # B
    cost = CostModel.model_validate_json(resolve_config_path("cost-tiny.json").read_text())
    spec = builtin("tiered-adaptive").with_cost_model(cost)
    trace = Trace("e2e-hold-per-conversation-host-copy", 4096, [
        ConversationSpec("long", 0.0, 301, [TurnSpec(300, 16, 0.0), TurnSpec(64, 16, 65.0)]),
        ConversationSpec("short", 68.0, 302, [TurnSpec(300, 16, 0.0)] + [TurnSpec(64, 16, 2.0)] * 4)])
    opts = RunOptions(model=model, kv_bytes_per_token=2048, log_dir=out / "logs-b", progress=False,
                      sample_interval_s=0.25)
    b = run_strategy(spec, trace, opts, stack_provider=provider)
    print("B", json.dumps(b.hold_choices()))
    print("B turns", [(t.conversation_id, t.turn, str(t.reuse_path), t.reused_tokens, t.hold_s, t.hold_basis, t.refusal, t.error[:80]) for t in b.turns])
    print("B block-s", b.device_block_seconds(), b.meta.get("device_blocks_source"), flush=True)
    write_report([b], out / "report-b", {"model": "tiny", "trace": trace.name, "mode": "live",
                 "conversations": 2, "turns": 7, "measurement": MEASUREMENT,
                 "command": "one-off: tiered-adaptive WITH its host copy, configs/cost-tiny.json, "
                            "the e2e hold trace (KVTierNixlConnector registered via a sitecustomize)"},
                 plots=False)
    write_report([a], out / "report-a", {"model": "tiny", "trace": short.name, "mode": "live",
                 "conversations": 2, "turns": 6, "measurement": MEASUREMENT,
                 "command": "one-off: tiered-adaptive as deployed (renew, no cost model)"}, plots=False)
