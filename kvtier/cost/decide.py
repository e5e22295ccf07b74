"""Which KV path serves a prefill: load from one of several sources, or recompute.

Pure arithmetic, no I/O, no vLLM: the decision ``CostAwareConnector`` makes
for every request, kept here so it is unit-tested on its own. The costs come
from the one cost model kvtier has, ``kvtier.cost.model.CostModel``
(fitted by ``kvtier calibrate``); this module only maps the connector's
children onto its read paths and breaks ties.

Expected time to have the KV of a prompt's ``remaining`` tokens (those not
already in the engine's own prefix cache, which holds ``cached``) when a path
offers ``t`` of them::

    cost(path) = read_s(path, t) + prefill_s(remaining - t, cached + t)
    cost(none) = prefill_s(remaining, cached)

The cheapest wins. Ties (within a relative 1e-9) go to more tokens loaded,
then to the earlier path in config order (what MultiConnector would have
picked), so with equal costs the behaviour is MultiConnector's.

The connector's ``cost`` config takes either form:

- **fitted** (preferred): ``{"fitted": "cost.json" | {...}, "paths": ["dp_read", "p2p"]}``:
  the JSON ``kvtier calibrate --out`` wrote, and per child the read path of that model
  it stands for (``"local"`` is a free path).
- **flat** (hand-written): ``{"recompute_tokens_per_s": R, "paths": [{"setup_s": S,
  "bandwidth_bytes_per_s": B}, ...]}``: recompute linear in tokens (no attention term,
  which is optimistic for long prompts and so errs towards loading less).

Threading model: stateless functions over frozen values.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from kvtier.cost.model import LOCAL_PATH, LinkModel
from kvtier.cost.model import CostModel as FittedCost

log = logging.getLogger(__name__)

_TIE = 1e-9  # relative: costs closer than this are equal


class PathCost(BaseModel):
    """Cost parameters of one load path (one child connector), flat form."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    setup_s: float = Field(default=0.0, ge=0)
    bandwidth_bytes_per_s: float = Field(gt=0)


class CostModel(BaseModel):
    """The connector's ``cost`` config: the fitted model plus one read path per child."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    paths: tuple[PathCost | str, ...]
    fitted: FittedCost | None = None
    recompute_tokens_per_s: float | None = Field(default=None, gt=0)
    # Bytes of KV per token (all layers); None: the engine adapter fills it in.
    bytes_per_token: int | None = Field(default=None, gt=0)
    _resolved: tuple[Any, FittedCost, tuple[str, ...]] | None = PrivateAttr(default=None)

    @model_validator(mode="before")
    @classmethod
    def _load_fitted_file(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("fitted"), (str, Path)):
            f = Path(data["fitted"]).expanduser()
            try:
                doc = json.loads(f.read_text())
            except OSError as e:
                raise ValueError(f"cost.fitted: cannot read {f}: {e.strerror}") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"cost.fitted: {f} is not JSON ({e})") from None
            data = {**data, "fitted": doc}
        return data

    @model_validator(mode="after")
    def _one_form(self) -> CostModel:
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

    def with_bytes_per_token(self, n: int) -> CostModel:
        """Fill in the engine's KV bytes per token (the engine's layout wins over a fit's)."""
        if self.bytes_per_token is not None:
            return self
        if self.fitted is not None and self.fitted.kv_bytes_per_token != n:
            log.warning("cost.fitted was calibrated at %d KV bytes/token; this engine has %d: "
                        "using the engine's", self.fitted.kv_bytes_per_token, n)
        return self.model_copy(update={"bytes_per_token": n})

    def resolved(self) -> tuple[FittedCost, tuple[str, ...]]:
        """The cost model the arithmetic uses, and each child's read-path name in it
        (built once per configuration; cached against the fields it is built from, which
        ``model_copy(update=...)`` may change)."""
        key = (self.bytes_per_token, self.paths, self.recompute_tokens_per_s, id(self.fitted))
        if self._resolved is None or self._resolved[0] != key:
            cost, names = self._resolve()
            self._resolved = (key, cost, names)
        return self._resolved[1], self._resolved[2]

    def _resolve(self) -> tuple[FittedCost, tuple[str, ...]]:
        if self.bytes_per_token is None:
            raise ValueError("bytes_per_token is unknown")
        if self.fitted is not None:
            return (self.fitted.model_copy(update={"kv_bytes_per_token": self.bytes_per_token}),
                    tuple(str(p) for p in self.paths))
        names = tuple(f"path{i}" for i in range(len(self.paths)))
        reads = {n: LinkModel(setup_s=p.setup_s, bytes_per_s=p.bandwidth_bytes_per_s)
                 for n, p in zip(names, self.paths) if isinstance(p, PathCost)}
        assert self.recompute_tokens_per_s is not None
        return (FittedCost(kv_bytes_per_token=self.bytes_per_token, reads=reads,
                           prefill_b_s_per_token=1.0 / self.recompute_tokens_per_s), names)


class Choice(BaseModel):
    model_config = ConfigDict(frozen=True)

    path: int | None  # index into the offers; None: recompute everything
    tokens: int  # tokens loaded on that path (0 for recompute)
    expected_s: float
    recompute_s: float  # expected time of recomputing everything, for comparison


def choose_path(offers: Sequence[int], remaining: int, model: CostModel,
                cached: int = 0) -> Choice:
    """Pick the cheapest way to obtain ``remaining`` tokens' KV on top of ``cached``.

    ``offers[i]`` is how many of those tokens path ``i`` can load (0: none);
    an offer larger than ``remaining`` is counted as ``remaining`` for the
    recompute part (a connector may round up to a block) but loads in full.
    """
    if len(offers) != len(model.paths):
        raise ValueError(f"{len(offers)} offers for {len(model.paths)} configured paths")
    if remaining < 0 or cached < 0 or any(t < 0 for t in offers):
        raise ValueError(f"negative token count: remaining={remaining} cached={cached} "
                         f"offers={list(offers)}")
    cost, names = model.resolved()
    everything = cost.prefill_s(remaining, cached)
    best = Choice(path=None, tokens=0, expected_s=everything, recompute_s=everything)
    for i, (t, name) in enumerate(zip(offers, names)):
        if t <= 0:
            continue
        used = min(t, remaining)
        s = cost.read_s(name, t) + cost.prefill_s(remaining - used, cached + used)
        eps = _TIE * max(s, best.expected_s)
        if s < best.expected_s - eps or (abs(s - best.expected_s) <= eps and t > best.tokens):
            best = Choice(path=i, tokens=t, expected_s=s, recompute_s=everything)
    return best

