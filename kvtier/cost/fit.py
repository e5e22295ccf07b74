"""Fitting the cost model: one joint fit of prefill and reads, and a bare-link fit.

- ``fit_turns(samples, ...)`` is how a ``CostModel`` is fitted (``kvtier calibrate``, the A/B
  report's in-sample refit, the GPU calibration benchmark). Each sample is one prefill: it
  computed ``computed_tokens`` on top of ``reused_tokens`` it already had, which came over
  ``path`` (``local``/``none``: no transfer; ``dp_read``/``p2p``: a read), in ``seconds``. One
  non-negative least-squares fit over every sample::

      seconds = a + b·n + c·n·(k + n/2)  +  [took path p]·(setup_p + k·bytes_per_token / bw_p)

  with ``n`` computed and ``k`` reused tokens. Fitting prefill on no-reuse samples alone
  would extrapolate from (long new, no cache) to (short new, long cache), where agentic
  follow-ups live; the joint fit sees both. Relative error (each row weighted by
  1/seconds, then in log space: `_nnls_relative`), so 5 ms and 5 s prefills count alike
  and noisy samples do not pull the fit under the typical one. A read path no sample took borrows the
  other path's link, or the prior link (``kvtier.cost.model.NIXL_CPU_PRIOR``); every choice is written into ``fit_notes``.
- ``fit_link(samples)`` fits ``setup + bytes / bandwidth`` to bare transfers (a link measured
  on its own, e.g. host copies over PCIe), not a whole cost model.

Both use ``scipy.optimize.nnls`` (Lawson-Hanson): every coefficient is a cost, never negative.

Threading model: pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np
from scipy.optimize import least_squares, nnls

from kvtier.cost.model import NIXL_CPU_PRIOR, CostModel, LinkModel
from kvtier.ids import ReusePath

READ_PATHS: tuple[ReusePath, ...] = (ReusePath.DP_READ, ReusePath.P2P)
_PRIOR_NOTE = (f"setup {NIXL_CPU_PRIOR.setup_s * 1e3:g} ms, "
               f"{NIXL_CPU_PRIOR.bytes_per_s / 1e9:g} GB/s")
UNBOUNDED_BPS = 1e15  # a fitted bandwidth term of zero: reading costs only its setup


class ServiceSample(msgspec.Struct, frozen=True):
    """One measured prefill (its service time, contention already taken out)."""

    computed_tokens: int
    reused_tokens: int
    path: str  # a ReusePath value: how the reused tokens arrived
    seconds: float


class ReadSample(msgspec.Struct, frozen=True):
    """One bare transfer of ``bytes`` taking ``seconds`` (setup included)."""

    bytes: int
    seconds: float


def _nnls_relative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative ``coef`` with ``x·coef ≈ y`` in relative error, aimed at the median.

    A first pass minimises ``Σ (x·coef / y - 1)²`` (`scipy.optimize.nnls` on rows divided by
    ``y``). On noisy measurements (a loaded 2-core machine: TTFTs of one size spread 3-10x)
    that settles under the typical sample, since over-predicting a fast sample costs more
    than under-predicting a slow one: the simulated TTFT p50 came out 25-50% under the
    measured one. So the fit then minimises ``Σ log(x·coef / y)²`` from there
    (`scipy.optimize.least_squares`, coefficients bounded at 0): multiplicative noise
    either way counts alike and the prediction lands on the median. Exact data gives the
    same answer either way."""
    coef, _residual = nnls(x / y[:, None], np.ones_like(y))
    if len(y) <= x.shape[1]:
        return np.asarray(coef)
    floor = float(np.min(y)) * 1e-6
    logy = np.log(y)

    def resid(c: np.ndarray) -> np.ndarray:
        return np.log(np.maximum(x @ c, floor)) - logy

    def jac(c: np.ndarray) -> np.ndarray:
        return x / np.maximum(x @ c, floor)[:, None]

    start = np.maximum(coef, 0.0) + 1e-12
    fit = least_squares(resid, start, jac=jac, bounds=(0.0, np.inf), method="trf",
                        x_scale="jac")
    return np.asarray(fit.x) if fit.success else np.asarray(coef)


def fit_turns(samples: Sequence[ServiceSample], kv_bytes_per_token: int,
              block_size: int) -> CostModel:
    """The cost model that best explains ``samples`` (see the module docstring)."""
    rows: list[list[float]] = []
    ys: list[float] = []
    for s in samples:
        if s.seconds <= 0 or s.computed_tokens <= 0:
            continue
        n, k = float(s.computed_tokens), float(s.reused_tokens)
        row = [1.0, n, n * (k + n / 2)]
        for path in READ_PATHS:
            took = s.path == path and s.reused_tokens > 0
            row += [1.0 if took else 0.0, k * kv_bytes_per_token if took else 0.0]
        rows.append(row)
        ys.append(s.seconds)
    if len(rows) < 3:
        raise ValueError(f"need at least 3 samples with computed tokens and positive seconds, "
                         f"got {len(rows)}")
    x, y = np.array(rows), np.array(ys)
    coef = _nnls_relative(x, y)
    a, b, c = (float(v) for v in coef[:3])
    notes = [f"joint fit over {len(rows)} prefills (relative non-negative least squares)"]
    links: dict[str, LinkModel] = {}
    for i, path in enumerate(READ_PATHS):
        used = int(x[:, 3 + 2 * i].sum())
        if not used:
            notes.append(f"{path}: no sample took this path")
            continue
        setup, per_byte = float(coef[3 + 2 * i]), float(coef[4 + 2 * i])
        bw = 1.0 / per_byte if per_byte > 0 else UNBOUNDED_BPS
        links[path.value] = LinkModel(setup_s=setup, bytes_per_s=bw)
        notes.append(f"{path}: {used} samples; setup {setup * 1e3:.0f} ms, "
                     + (f"{bw / 1e9:.3g} GB/s" if per_byte > 0 else
                        "no size-dependent cost found (bandwidth unbounded)"))
    for path in READ_PATHS:
        if path.value not in links:
            other = next((p for p in READ_PATHS if p.value in links), None)
            links[path.value] = links[other.value] if other else NIXL_CPU_PRIOR
            notes.append(f"{path}: borrowed from {other}" if other else
                         f"{path}: prior ({_PRIOR_NOTE}: NIXL on a CPU host), nothing measured")
    return CostModel(kv_bytes_per_token=kv_bytes_per_token, prefill_a_s=a,
                     prefill_b_s_per_token=b, prefill_c_s_per_token_ctx=c, reads=links,
                     block_size=block_size, fit_notes=tuple(notes))


def fit_link(samples: Sequence[ReadSample]) -> LinkModel:
    """Least-squares ``setup_s + bytes / bytes_per_s`` (needs two distinct sizes)."""
    nb = np.array([s.bytes for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples], dtype=float)
    if len(set(nb.tolist())) < 2:
        raise ValueError("need read samples of at least two distinct sizes")
    if np.any(y <= 0):
        raise ValueError("read samples need positive seconds")
    setup, per_byte = _nnls_relative(np.column_stack([np.ones_like(nb), nb]), y)
    if per_byte <= 0:
        raise ValueError("read time does not grow with size; cannot fit a bandwidth")
    return LinkModel(setup_s=float(setup), bytes_per_s=float(1.0 / per_byte))
