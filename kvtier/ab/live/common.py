"""What ``kvtier ab``, ``kvtier calibrate`` and ``kvtier demo`` share: the model a run serves,
the facts read from its config, the prior cost model and the simulated fleet.

Threading model: plain functions, called on the command's thread.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.cost.model import NIXL_CPU_PRIOR, CostModel, kv_bytes_per_token
from kvtier.devstack.platform import kv_dtype_bytes

if TYPE_CHECKING:
    from kvtier.ab.simulator import FleetSpec


def resolve_model(name: str) -> Path:
    """A preset (``tiny``, ``bench``: built or reused) or a model directory."""
    if name in ("tiny", "bench"):
        from kvtier.devstack.models import build_model

        return Path(build_model(name))
    p = Path(name)
    if not (p / "config.json").exists():
        raise SystemExit(f"--model {name!r}: not a preset (tiny, bench) nor a model directory")
    return p


def model_facts(model_dir: Path) -> tuple[int, int]:
    """(KV bytes per token at the stack's serving dtype, max context) from config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return (kv_bytes_per_token(cfg, kv_dtype_bytes()),
            int(cfg.get("max_position_embeddings", 4096)))


def prior_cost_model(kvbpt: int, block_size: int = 32) -> CostModel:
    """Cost model used when nothing was measured (``--simulate`` without ``--cost``):
    tiny-model-on-this-CPU magnitudes, both reads over the prior link; say so in the report."""
    return CostModel(kv_bytes_per_token=kvbpt, prefill_a_s=0.01, prefill_b_s_per_token=2e-4,
                     prefill_c_s_per_token_ctx=2e-8, decode_s_per_token=0.004,
                     reads={"dp_read": NIXL_CPU_PRIOR, "p2p": NIXL_CPU_PRIOR},
                     block_size=block_size)


def sim_fleet(prefill: int, decode: int, block_size: int,
              decode_blocks: int | None = None, decode_interference: float = 0.0) -> FleetSpec:
    """The simulated fleet; ``decode_blocks`` (a regime's ``decode_num_blocks``), when set, is
    each decode instance's KV capacity, as ``--num-gpu-blocks-override`` is on the stack;
    ``decode_interference`` > 0 models the local stack's shared host (`FleetSpec`)."""
    from kvtier.ab.simulator import FleetSpec

    return FleetSpec(prefill=prefill, decode=decode, block_size=block_size,
                     decode_interference=decode_interference,
                     **({"device_blocks_per_decode": decode_blocks} if decode_blocks else {}))


def quiet_http_logs() -> None:
    """One line per HTTP call / served request would bury the progress bar."""
    for name in ("httpx", "kvtier.router"):
        logging.getLogger(name).setLevel(logging.WARNING)
