"""The step cost model the target_itl_ms cap reads: a least-squares fit of step
time to tokens and encoder tokens over the newest steps."""
from __future__ import annotations

import pytest

from foveal.engine.step_cost import StepCostModel


def linear(tokens: int, encoder_tokens: int) -> float:
    return 0.010 + 0.001 * tokens + 0.002 * encoder_tokens


def started() -> StepCostModel:
    """A model past the engine's first step, which it does not use."""
    model = StepCostModel()
    model.observe(728, 500, 1.94)
    return model


POINTS = [(1, 0), (50, 0), (20, 30), (100, 0), (4, 40), (8, 0), (2, 64), (70, 0)]


def test_recovers_a_linear_cost():
    model = started()
    for tokens, encoder_tokens in POINTS:
        model.observe(tokens, encoder_tokens, linear(tokens, encoder_tokens))
    assert model.coefficients == pytest.approx((0.010, 0.001, 0.002))
    assert model.predict(30, 5) == pytest.approx(linear(30, 5))


def test_no_fit_until_enough_steps_differ():
    model = started()
    for _ in range(10):
        model.observe(8, 0, 0.05)  # decode steps of one size: base and per token are one
    assert not model.ready and model.predict(8) is None
    for extra in range(3):  # min_points=3 steps min_spread=16 tokens from the median
        model.observe(8 + 16 + extra, 0, 0.07)
        assert model.ready == (extra == 2)
    assert model.coefficients[1] > 0


def test_the_first_step_and_slow_steps_are_left_out():
    model = StepCostModel()
    model.observe(728, 500, 1.94)  # the first step: kernels built, heap grown
    for tokens, encoder_tokens in POINTS[:4]:
        model.observe(tokens, encoder_tokens, linear(tokens, encoder_tokens))
    model.observe(900, 0, 4.0)  # a first use of something, on a large step
    model.observe(6, 0, 0.300)  # a pause
    for tokens, encoder_tokens in POINTS[4:]:
        model.observe(tokens, encoder_tokens, linear(tokens, encoder_tokens))
    assert model.coefficients == pytest.approx((0.010, 0.001, 0.002))


def test_keeps_its_last_fit_when_the_window_stops_varying():
    model = StepCostModel(window=5)
    model.observe(1, 0, 0.011)
    for tokens in (1, 40, 80, 120, 2):
        model.observe(tokens, 0, linear(tokens, 0))
    fitted = model.coefficients
    assert fitted == pytest.approx((0.010, 0.001, 0.0))
    for _ in range(5):  # the window now holds only one-token steps
        model.observe(1, 0, 0.5)
    assert model.coefficients == fitted


def test_a_cost_that_would_come_out_negative_is_dropped_from_the_fit():
    model = started()
    # time falls as encoder tokens rise: no negative cost, the encoder term goes
    for tokens, encoder_tokens, seconds in [(10, 0, 0.03), (50, 0, 0.07), (10, 40, 0.02),
                                            (90, 20, 0.10), (30, 60, 0.04), (70, 0, 0.09)]:
        model.observe(tokens, encoder_tokens, seconds)
    base, per_token, per_encoder_token = model.coefficients
    assert per_encoder_token == 0.0 and per_token > 0 and base >= 0


def test_plans_that_compute_nothing_are_not_steps():
    model = started()
    model.observe(0, 0, 0.001)
    for tokens in (1, 64, 2, 40, 80):
        model.observe(tokens, 0, linear(tokens, 0))
    assert model.coefficients == pytest.approx((0.010, 0.001, 0.0))


def test_correction_is_the_median_ratio_of_sized_steps_to_the_fit():
    model = started()
    for tokens, encoder_tokens in POINTS:
        model.observe(tokens, encoder_tokens, linear(tokens, encoder_tokens))
    model.observe(30, 0, 2 * linear(30, 0))  # not sized: the fit's business alone
    assert model.correction == 1.0
    for ratio in (1.2, 1.5, 9.0):  # min_points sized steps; the median ignores the pause
        model.observe(20, 0, ratio * model.predict(20), sized=True)
        assert model.correction == (1.5 if ratio == 9.0 else 1.0)
    for _ in range(16):  # the newest sized_window steps, within 0.5-4
        model.observe(20, 0, 0.1 * model.predict(20), sized=True)
    assert model.correction == 0.5


def test_sized_steps_before_a_fit_are_not_counted():
    model = started()
    for _ in range(5):
        model.observe(20, 0, 0.05, sized=True)
    assert not model.ready and model.correction == 1.0
