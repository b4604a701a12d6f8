"""What a step costs, learnt from the steps the engine has run.

seconds ~= base + per_token * tokens + per_encoder_token * encoder_tokens

`tokens` are the step's scheduled tokens (prompt chunks, decode rows, drafts),
`encoder_tokens` the visual tokens the vision tower produced in it. The fit is
least squares over the last `window` steps, coefficients kept non-negative (a
feature whose coefficient would go negative is dropped from that fit). The
first step is not used (it pays one-time costs: kernels built, the heap grown,
first-use dispatch, on the engine's largest prefill, where one point would
pull the whole line), and a step that took over twice what the fit of the
other steps predicts for it is left out and the fit redone: a first use of a
kernel later on or a pause of the process must not make every later step look
expensive. A cost is fitted only from
enough steps that differ in it (`min_points` of them `min_spread` tokens or
more away from the median step). The machine, the model and the context lengths
set the numbers, so they are measured here rather than configured. The
scheduler reads them to size prefill chunks that keep decode steps near a
target inter-token latency (`target_itl_ms`).

A straight line through steps of every size misses the cost of the steps the
target sizes (a few decode rows and a prompt chunk: measured up to a third over
the line on the `small` preset, whose per-token cost falls with the step's
size). Those steps are reported (`sized=True`) and `correction` is the median of
their measured over predicted time, which the scheduler divides the target by.
"""
from __future__ import annotations

from collections import deque
from itertools import combinations

import numpy as np

# Tokens (and encoder tokens) are fitted per thousand: columns of like size.
_SCALE = 1000.0
_SLOW = 2.0  # a step this many times its predicted time (plus 1 ms) is an outlier
_CORRECTION_RANGE = (0.5, 4.0)


class StepCostModel:
    def __init__(self, window: int = 64, min_spread: int = 16, min_points: int = 3,
                 sized_window: int = 16):
        """window: steps the fit reads (the newest). A cost needs min_points steps
        at least min_spread tokens away from the median step, else it cannot be
        told from the base: until the per-token cost can, the last fit stays.
        sized_window: the newest sized steps `correction` reads (min_points of
        them at least)."""
        self._steps: deque[tuple[int, int, float]] = deque(maxlen=window)
        self._sized: deque[float] = deque(maxlen=sized_window)
        self._min_spread = min_spread
        self._min_points = min_points
        self._coef: tuple[float, float, float] | None = None
        self._stale = False
        self._seen_first = False

    def observe(self, tokens: int, encoder_tokens: int, seconds: float, sized: bool = False) -> None:
        """A step's measured time; `sized`: the scheduler sized it to the target."""
        if tokens <= 0 and encoder_tokens <= 0:
            return  # a plan that only told the workers to drop state
        if not self._seen_first:
            self._seen_first = True
            return
        predicted = self.predict(tokens, encoder_tokens) if sized else None
        if predicted:  # from the fit the step was sized by, before this step joins it
            self._sized.append(seconds / predicted)
        self._steps.append((tokens, encoder_tokens, seconds))
        self._stale = True

    @property
    def correction(self) -> float:
        """Measured over predicted time of the newest sized steps (their median,
        within 0.5-4), or 1 until there are min_points of them."""
        if len(self._sized) < self._min_points:
            return 1.0
        low, high = _CORRECTION_RANGE
        return float(min(high, max(low, np.median(self._sized))))

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
        keep = np.ones(len(steps), dtype=bool)
        for _ in range(4):  # drop the slowest outlier, refit
            solved = self._solve(steps[keep])
            if solved is None:
                return None
            coef, kept = solved
            rows = steps[keep]
            columns = _columns(rows)[:, kept]
            # each step's prediction from the fit without it (a large step pulls the
            # line through itself: its own residual says nothing)
            leverage = np.einsum("ij,ji->i", columns, np.linalg.pinv(columns))
            residual = rows[:, 2] - (coef[0] + rows[:, :2] @ np.array(coef[1:]))
            judged = leverage < 0.99
            without = rows[:, 2] - residual / np.where(judged, 1 - leverage, 1.0)
            excess = np.where(judged, rows[:, 2] - (_SLOW * np.maximum(without, 0) + 1e-3),
                              -np.inf)
            worst = int(np.argmax(excess))
            if excess[worst] <= 0:
                return coef
            keep[np.flatnonzero(keep)[worst]] = False
        solved = self._solve(steps[keep])
        return None if solved is None else solved[0]

    def _varies(self, values: np.ndarray) -> bool:
        far = np.abs(values - np.median(values)) >= self._min_spread
        return int(far.sum()) >= self._min_points

    def _solve(self, steps: np.ndarray) -> tuple[tuple[float, float, float], tuple] | None:
        """(base, per token, per encoder token) and the columns fitted, or None."""
        if len(steps) == 0 or not self._varies(steps[:, 0]):
            return None
        columns, seconds = _columns(steps), steps[:, 2]
        has_encoder = self._varies(steps[:, 1])
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
                    return (coef[0], coef[1], coef[2]), kept
        return None


def _columns(steps: np.ndarray) -> np.ndarray:
    """[1, tokens / 1000, encoder tokens / 1000] per step."""
    return np.stack([np.ones(len(steps)), steps[:, 0] / _SCALE, steps[:, 1] / _SCALE], axis=1)
