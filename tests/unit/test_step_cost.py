"""The step cost model the target_itl_ms cap reads: a least-squares fit of step
time to tokens and encoder tokens over the newest steps."""
from __future__ import annotations

import pytest

from foveal.engine.step_cost import StepCostModel


def linear(tokens: int, encoder_tokens: int) -> float:
    return 0.010 + 0.001 * tokens + 0.002 * encoder_tokens


def test_recovers_a_linear_cost():
    model = StepCostModel()
    for tokens, encoder_tokens in [(1, 0), (50, 0), (20, 10), (100, 0), (4, 40), (8, 0)]:
        model.observe(tokens, encoder_tokens, linear(tokens, encoder_tokens))
    assert model.coefficients == pytest.approx((0.010, 0.001, 0.002))
    assert model.predict(30, 5) == pytest.approx(linear(30, 5))


def test_no_fit_until_token_counts_vary():
    model = StepCostModel(min_token_spread=16)
    for _ in range(10):
        model.observe(8, 0, 0.05)  # decode steps of one size: base and per token are one
    assert not model.ready and model.predict(8) is None
    model.observe(8 + 16, 0, 0.07)
    assert model.ready and model.coefficients[1] > 0


def test_keeps_its_last_fit_when_the_window_stops_varying():
    model = StepCostModel(window=4)
    for tokens in (1, 40, 80, 120):
        model.observe(tokens, 0, linear(tokens, 0))
    fitted = model.coefficients
    for _ in range(4):  # the window now holds only one-token steps
        model.observe(1, 0, 0.5)
    assert model.coefficients == fitted


def test_a_cost_that_would_come_out_negative_is_dropped_from_the_fit():
    model = StepCostModel()
    # time falls as encoder tokens rise: no negative cost, the encoder term goes
    for tokens, encoder_tokens, seconds in [(10, 0, 0.03), (50, 0, 0.07), (10, 40, 0.02),
                                            (90, 20, 0.10)]:
        model.observe(tokens, encoder_tokens, seconds)
    base, per_token, per_encoder_token = model.coefficients
    assert per_encoder_token == 0.0 and per_token > 0 and base >= 0


def test_plans_that_compute_nothing_are_not_steps():
    model = StepCostModel()
    model.observe(0, 0, 0.001)
    for tokens in (1, 64):
        model.observe(tokens, 0, linear(tokens, 0))
    assert model.coefficients == pytest.approx((0.010, 0.001, 0.0))
