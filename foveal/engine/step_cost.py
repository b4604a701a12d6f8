"""What a step costs, learnt from the steps the engine has run.

seconds ~= base + per_token * tokens + per_encoder_token * encoder_tokens

`tokens` are the step's scheduled tokens (prompt chunks, decode rows, drafts),
`encoder_tokens` the visual tokens the vision tower produced in it. The fit is
least squares over the last `window` steps, coefficients kept non-negative (a
feature whose coefficient would go negative is dropped from that fit). The
machine, the model and the context lengths set the numbers, so they are measured
here rather than configured. The scheduler reads them to size prefill chunks
that keep decode steps near a target inter-token latency (`target_itl_ms`).
"""
from __future__ import annotations

from collections import deque
from itertools import combinations

import numpy as np

# Tokens (and encoder tokens) are fitted per thousand: columns of like size.
_SCALE = 1000.0


class StepCostModel:
    def __init__(self, window: int = 64, min_token_spread: int = 16):
        """window: steps the fit reads (the newest). min_token_spread: the fit
        needs steps whose token counts differ by at least this much, else the
        per-token cost cannot be told from the base and the last fit stays."""
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._min_spread = min_token_spread
        self._coef: tuple[float, float, float] | None = None
        self._stale = False

    def observe(self, tokens: int, encoder_tokens: int, seconds: float) -> None:
        if tokens <= 0 and encoder_tokens <= 0:
            return  # a plan that only told the workers to drop state
        self._steps.append((tokens, encoder_tokens, seconds))
        self._stale = True

    @property
    def ready(self) -> bool:
        """Whether a fit exists (the steps seen so far varied enough)."""
        return self.coefficients is not None

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(base s, s per token, s per encoder token), or None before the first fit."""
        if self._stale:
            self._stale = False
            fit = self._fit()
            if fit is not None:
                self._coef = fit
        return self._coef

    def predict(self, tokens: int, encoder_tokens: int = 0) -> float | None:
        coef = self.coefficients
        if coef is None:
            return None
        base, per_token, per_encoder_token = coef
        return base + per_token * tokens + per_encoder_token * encoder_tokens

    def _fit(self) -> tuple[float, float, float] | None:
        steps = np.array(self._steps, dtype=np.float64)
        tokens, encoder, seconds = steps[:, 0], steps[:, 1], steps[:, 2]
        if tokens.max() - tokens.min() < self._min_spread:
            return None
        columns = np.stack([np.ones_like(tokens), tokens / _SCALE, encoder / _SCALE], axis=1)
        has_encoder = encoder.max() - encoder.min() >= self._min_spread
        # every subset of the features that keeps the per-token column, largest first
        for size in (3, 2, 1):
            for kept in combinations(range(3), size):
                if 1 not in kept or (2 in kept and not has_encoder):
                    continue
                solution, *_ = np.linalg.lstsq(columns[:, kept], seconds, rcond=None)
                if (solution >= 0).all() and solution[kept.index(1)] > 0:
                    coef = [0.0, 0.0, 0.0]
                    for index, value in zip(kept, solution):
                        coef[index] = float(value) / (_SCALE if index else 1.0)
                    return coef[0], coef[1], coef[2]
        return None
