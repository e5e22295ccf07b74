"""The cost model a router decides with, refitted online from the prefills it times.

A committed calibration (``configs/cost-*.json``, ``kvtier calibrate``) is measured on an idle
stack. Under load the costs move, and not alike: a live host-scarce A/B on the CPU stack
measured a prefill at ~89 ms whatever its length and a D->P read at 71 ms of setup, where the
idle calibration said a device read saves ~90 ms. The router, deciding with the calibration,
held 146 of 180 turns on the decode device for reads that did not pay.

``OnlineCost`` starts from that calibration (the *prior*) and refits it from the router's own
measurements: every prefill leg it times is a ``ServiceSample`` (tokens computed, tokens reused
and over which path, seconds from the leg's send to its answer, queueing included: that is
what the next turn will see). Once ``min_samples`` are in the window, and every
``refit_every`` samples after that, it fits ``kvtier.cost.fit.fit_turns`` over

- the last ``window`` samples, and
- ``prior_samples`` pseudo-samples from the prior (recompute at sizes spread over the block
  size to the largest prompt seen), so a window of similar prompts cannot swing the
  per-token terms anywhere the data does not constrain them.

A read path with fewer than ``min_path_samples`` measured reads in the window keeps the
prior's link: a policy that stopped taking a path learns nothing new about it, and the fit
would otherwise borrow another path's link. The KV size, block size and decode time per token
are the prior's (prefill legs do not measure them).

A refit that fails (too few distinct samples, a solver error) keeps the model in use and says
why (``last_error``). Each refit's model carries its provenance in ``fit_notes``.

Threading model: not thread-safe; one router event loop owns an instance.
"""

from __future__ import annotations

import math
from collections import deque

from kvtier.cost.fit import READ_PATHS, ServiceSample, fit_turns
from kvtier.cost.model import CostModel
from kvtier.ids import ReusePath

PRIOR_CONTEXT_TOKENS = 4096  # the largest recompute the prior's pseudo-samples cover by default


class OnlineCost:
    def __init__(self, prior: CostModel, *, window: int = 256, min_samples: int = 16,
                 refit_every: int = 8, min_path_samples: int = 8,
                 prior_samples: int = 8) -> None:
        if window < 3 or min_samples < 3 or refit_every < 1 or min_path_samples < 1:
            raise ValueError("window and min_samples must be >= 3, refit_every and "
                             "min_path_samples >= 1")
        if min_samples > window:
            raise ValueError(f"min_samples ({min_samples}) cannot exceed window ({window})")
        if prior_samples < 0:
            raise ValueError("prior_samples must be >= 0")
        self.prior = prior
        self.model = prior
        self.window, self.min_samples = window, min_samples
        self.refit_every, self.min_path_samples = refit_every, min_path_samples
        self.prior_samples = prior_samples
        self.samples: deque[ServiceSample] = deque(maxlen=window)
        self.seen = 0          # samples observed in all
        self.refits = 0        # refits that changed the model in use
        self.attempts = 0      # refits tried (every refit_every samples, failed ones too)
        self.last_error: str | None = None
        self._since_refit = 0
        self._largest = 0

    def observe(self, computed_tokens: int, reused_tokens: int, path: str,
                seconds: float) -> bool:
        """One timed prefill leg; True when it triggered a refit that changed the model."""
        if computed_tokens <= 0 or not seconds > 0 or not math.isfinite(seconds):
            return False
        path = ReusePath(path).value  # a bad path name is a caller bug: raise
        reused = max(0, reused_tokens)
        self.samples.append(ServiceSample(computed_tokens, reused, path, float(seconds)))
        self._largest = max(self._largest, computed_tokens + reused)
        self.seen += 1
        self._since_refit += 1
        if len(self.samples) < self.min_samples or (
                self.attempts and self._since_refit < self.refit_every):
            return False
        self._since_refit = 0
        self.attempts += 1
        return self.refit()

    def refit(self) -> bool:
        """Refit from the window now; True when the model in use changed."""
        try:
            fitted = fit_turns(list(self.samples) + self._prior_samples(),
                               self.prior.kv_bytes_per_token, self.prior.block_size)
        except (ValueError, ArithmeticError) as e:
            self.last_error = f"refit over {len(self.samples)} samples failed: {e}"
            return False
        self.last_error = None
        taken = {p.value: sum(1 for s in self.samples if s.path == p.value and s.reused_tokens > 0)
                 for p in READ_PATHS}
        reads = dict(fitted.reads)
        notes = [f"online refit #{self.refits + 1}: {len(self.samples)} measured prefills "
                 f"(of {self.seen}) + {self.prior_samples} from the prior"]
        for path, n in taken.items():
            if n < self.min_path_samples and path in self.prior.reads:
                reads[path] = self.prior.reads[path]
                notes.append(f"{path}: {n} measured reads (< {self.min_path_samples}): the "
                             "prior's link")
            else:
                link = reads[path]
                notes.append(f"{path}: {n} measured reads; setup {link.setup_s * 1e3:.3g} ms")
        for path, link in self.prior.reads.items():
            reads.setdefault(path, link)  # links beyond the fitted ones (e.g. host_local)
        model = fitted.model_copy(update={
            "reads": reads, "decode_s_per_token": self.prior.decode_s_per_token,
            "fit_notes": tuple(notes) + fitted.fit_notes})
        if model == self.model:
            return False
        self.model = model
        self.refits += 1
        return True

    def _prior_samples(self) -> list[ServiceSample]:
        """Recomputes the prior predicts, at sizes spread geometrically from one block to the
        largest prompt seen (at least ``PRIOR_CONTEXT_TOKENS``)."""
        k = self.prior_samples
        if k == 0:
            return []
        lo, hi = self.prior.block_size, max(PRIOR_CONTEXT_TOKENS, self._largest)
        sizes = [round(lo * (hi / lo) ** (i / max(1, k - 1))) for i in range(k)]
        return [ServiceSample(n, 0, ReusePath.NONE.value, self.prior.prefill_s(n))
                for n in sizes if self.prior.prefill_s(n) > 0]
