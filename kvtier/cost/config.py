"""The CostAwareConnector's ``cost`` config: which cost model, and which read path each child is.

Parsed once, when the connector starts, into a frozen ``CostConfig``; ``resolved()`` gives the
``kvtier.cost.model.CostModel`` the decider uses and each child's path name in it. Two forms:

- **fitted** (preferred): ``{"fitted": "cost.json" | {...}, "paths": ["dp_read", "p2p"]}``:
  the JSON ``kvtier calibrate --out`` wrote, and per child the read path of that model it
  stands for (``"local"`` is a free path). A relative file name is looked up in the working
  directory first, then in the repository's ``configs/`` folder, so a shipped config can name
  a shipped calibration (``configs/costaware-nixl-kvtier.json`` names ``cost-tiny.json``).
- **flat** (hand-written): ``{"recompute_tokens_per_s": R, "paths": [{"setup_s": S,
  "bandwidth_bytes_per_s": B}, ...]}``: recompute linear in tokens (no attention term,
  which is optimistic for long prompts and so errs towards loading less).

``bytes_per_token`` defaults to the engine's KV bytes per token (the adapter fills it in).

Threading model: immutable values (``resolved()`` caches its result on the instance; a race
computes it twice, identically).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from kvtier.configs import CONFIG_DIR
from kvtier.cost.model import CostModel, LinkModel
from kvtier.ids import ReusePath

log = logging.getLogger(__name__)
LOCAL_PATH = ReusePath.LOCAL.value


def resolve_config_path(name: str | Path) -> Path:
    """``name`` as given if it exists (or is absolute), else the same name under ``configs/``."""
    f = Path(name).expanduser()
    if f.is_absolute() or f.exists() or not (CONFIG_DIR / f).exists():
        return f
    return CONFIG_DIR / f


class PathCost(BaseModel):
    """Cost parameters of one load path (one child connector), flat form."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    setup_s: float = Field(default=0.0, ge=0)
    bandwidth_bytes_per_s: float = Field(gt=0)


class CostConfig(BaseModel):
    """The connector's ``cost`` config: the fitted model plus one read path per child."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    paths: tuple[PathCost | str, ...]
    fitted: CostModel | None = None
    recompute_tokens_per_s: float | None = Field(default=None, gt=0)
    # Bytes of KV per token (all layers); None: the engine adapter fills it in.
    bytes_per_token: int | None = Field(default=None, gt=0)
    _resolved: tuple[Any, CostModel, tuple[str, ...]] | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _load_fitted_file(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("fitted"), (str, Path)):
            f = resolve_config_path(data["fitted"])
            try:
                doc = json.loads(f.read_text())
            except OSError as e:
                raise ValueError(f"cost.fitted: cannot read {f}: {e.strerror}") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"cost.fitted: {f} is not JSON ({e})") from None
            data = {**data, "fitted": doc}
        return data

    @model_validator(mode="after")
    def _one_form(self) -> CostConfig:
        if not self.paths:
            raise ValueError("cost.paths is empty: give one entry per child connector")
        if self.fitted is not None:
            if self.recompute_tokens_per_s is not None:
                raise ValueError("cost: give either fitted or recompute_tokens_per_s, not both")
            bad = [p for p in self.paths if not isinstance(p, str)]
            if bad:
                raise ValueError("cost.paths with fitted: name each child's read path "
                                 f"(e.g. \"dp_read\", \"p2p\"), got {bad[0]!r}")
            have = {*self.fitted.reads, LOCAL_PATH}
            missing = [p for p in self.paths if p not in have]
            if missing:
                raise ValueError(f"cost.paths {missing} not in the fitted model's reads "
                                 f"{sorted(have)}")
        else:
            if self.recompute_tokens_per_s is None:
                raise ValueError("cost needs fitted (a kvtier calibrate JSON) or "
                                 "recompute_tokens_per_s with a setup/bandwidth per path")
            if any(isinstance(p, str) for p in self.paths):
                raise ValueError("cost.paths names read paths only with fitted; "
                                 "give setup_s and bandwidth_bytes_per_s per path")
        return self

    def with_bytes_per_token(self, n: int) -> CostConfig:
        """Fill in the engine's KV bytes per token (the engine's layout wins over a fit's)."""
        if self.bytes_per_token is not None:
            return self
        if self.fitted is not None and self.fitted.kv_bytes_per_token != n:
            log.warning("cost.fitted was calibrated at %d KV bytes/token; this engine has %d: "
                        "using the engine's", self.fitted.kv_bytes_per_token, n)
        return self.model_copy(update={"bytes_per_token": n})

    def resolved(self) -> tuple[CostModel, tuple[str, ...]]:
        """The cost model the arithmetic uses, and each child's read-path name in it
        (built once per configuration; cached against the fields it is built from, which
        ``model_copy(update=...)`` may change)."""
        key = (self.bytes_per_token, self.paths, self.recompute_tokens_per_s, id(self.fitted))
        if self._resolved is None or self._resolved[0] != key:
            cost, names = self._resolve()
            self._resolved = (key, cost, names)
        return self._resolved[1], self._resolved[2]

    def _resolve(self) -> tuple[CostModel, tuple[str, ...]]:
        if self.bytes_per_token is None:
            raise ValueError("bytes_per_token is unknown")
        if self.fitted is not None:
            return (self.fitted.model_copy(update={"kv_bytes_per_token": self.bytes_per_token}),
                    tuple(str(p) for p in self.paths))
        names = tuple(f"path{i}" for i in range(len(self.paths)))
        reads = {n: LinkModel(setup_s=p.setup_s, bytes_per_s=p.bandwidth_bytes_per_s)
                 for n, p in zip(names, self.paths) if isinstance(p, PathCost)}
        assert self.recompute_tokens_per_s is not None
        return (CostModel(kv_bytes_per_token=self.bytes_per_token, reads=reads,
                           prefill_b_s_per_token=1.0 / self.recompute_tokens_per_s), names)
