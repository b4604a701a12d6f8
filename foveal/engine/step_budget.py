"""What one engine step may take: its token and encoder budgets, and, with a
target inter-token latency (`target_itl_ms`), the share of prompt work that fits
beside the decode rows.

A step that carries decode rows gives prompt tokens and vision encoding only what
the step cost model (foveal/engine/step_cost.py, fit to the steps run so far)
says fits in the target; decode rows come first whatever their place in the
running order. An encoding is charged at its measured cost in tokens, with the
window that reaches it (a bidirectional span whole). A held step that could take
no prompt work at all, while some waits, is followed by a progress step: it
takes just the window through the item that did not fit, its encoding not
charged (an image whose encoding alone is over the target still gets in, in a
step of its own), or, when not even one prompt token fits beside the decode rows
(a target below what they cost), the whole budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from foveal.config import SchedulerConfig
from foveal.engine.request import Request
from foveal.engine.step_cost import StepCostModel


@dataclass
class StepBudget:
    tokens_left: int
    encoder_tokens_left: int
    preempted: bool = False
    # With target_itl_ms: what prompt tokens (and, in a step held to the target, vision
    # encoding) may still take, in tokens; inf: no limit beyond tokens_left.
    prefill_left: float = math.inf
    held: bool = False  # held to the target: encodings are charged, encoder_token_cost each
    sized: bool = False  # held, and not a progress step: sized to the target
    encoder_token_cost: float = 0.0
    free_encodings: int = 0  # in a progress step: encodings not charged
    prefill_scheduled: int = 0  # prompt tokens (not decode rows) scheduled so far
    blocked_window: int = 0  # tokens through the first item whose encoding did not fit

    @property
    def prefill_room(self) -> int:
        """Prompt tokens the step may still take."""
        if self.prefill_left == math.inf:
            return self.tokens_left
        return max(0, min(self.tokens_left, math.floor(self.prefill_left)))

    def take_encoding(self, feature, start: int) -> bool:
        """Charge the encoding of `feature` for a request computed up to `start`;
        False when a held step has no room for it and the window through it."""
        if self.free_encodings:
            self.free_encodings -= 1
        elif self.held:
            cost = feature.num_encoder_tokens * self.encoder_token_cost
            window = window_into(feature, start)
            if cost + window > self.prefill_left:
                self.blocked_window = self.blocked_window or window
                return False
            self.prefill_left -= cost
        return True

    def take_tokens(self, request: Request, num_new: int) -> None:
        self.tokens_left -= num_new
        if not is_decoding(request):
            self.prefill_left -= num_new
            self.prefill_scheduled += num_new


def step_budget(config: SchedulerConfig, running: list[Request], step_cost: StepCostModel,
                progress_window: int | None) -> StepBudget:
    """The step's budgets. progress_window: None for a plain step, else the tokens a
    progress step takes (0: the whole budget) after a held step that took none."""
    budget = StepBudget(config.max_num_batched_tokens, config.encoder_compute_budget)
    if config.target_itl_ms is None:
        return budget
    decoding = [r for r in running if is_decoding(r)]
    coefficients = step_cost.coefficients if decoding else None
    if coefficients is None or progress_window == 0:  # None: no rows, or not measured yet
        return budget  # as without a target
    num_decode = sum(min(r.num_tokens_with_spec - r.num_computed_tokens,
                         config.max_model_len - r.num_computed_tokens) for r in decoding)
    budget.prefill_left = max(0, budget.tokens_left - num_decode)
    base, per_token, per_encoder_token = coefficients
    budget.held, budget.encoder_token_cost = True, per_encoder_token / per_token
    if progress_window is not None:
        budget.prefill_left = min(budget.prefill_left, progress_window)
        budget.free_encodings = 1
        return budget
    budget.sized = True
    target = config.target_itl_ms / 1000 / step_cost.correction
    affordable = (target - base) / per_token - num_decode
    budget.prefill_left = max(0, min(budget.prefill_left,
                                     math.floor(affordable + 1e-9)))  # float noise
    return budget


def is_decoding(request: Request) -> bool:
    """Past its prompt, one sampled token (and any drafts) left to compute."""
    return request.num_output_tokens > 0 and \
        request.num_computed_tokens >= request.num_tokens - 1


def window_into(feature, start: int) -> int:
    """The shortest window from `start` that reaches the item's first token left
    to compute without ending inside one of its bidirectional spans."""
    first = max(start, feature.placeholder.offset)
    end = next((span_end for span_start, span_end in feature.bidirectional_spans
                if span_start <= first < span_end), first + 1)
    return end - start
