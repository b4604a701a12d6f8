"""target_itl_ms: while requests decode, a step takes only the prompt tokens and
vision encoding the step cost model says fit beside the decode rows."""
from __future__ import annotations

import pytest
from test_gemma3_scheduling import bidirectional_image
from test_scheduler import (FakeExecutor, assert_all_returned, image, image_prompt, make_request,
                            make_scheduler, run_to_completion)

from foveal.engine.core import EngineCore
from foveal.engine.step_cost import StepCostModel

# Steps cost 10 ms + 1 ms per token + 2 ms per encoder token; at a 30 ms target a
# step holds 20 tokens, decode rows included, and an encoder token counts as 2.
BASE, PER_TOKEN, PER_ENCODER_TOKEN = 0.010, 0.001, 0.002


def seeded(scheduler):
    # the first is the engine's first step, which the model leaves out
    for tokens, encoder_tokens in [(1, 0), (50, 0), (4, 40), (100, 0), (2, 20), (3, 60),
                                   (80, 0), (30, 0)]:
        scheduler.step_cost.observe(tokens, encoder_tokens,
                                    BASE + PER_TOKEN * tokens + PER_ENCODER_TOKEN * encoder_tokens)
    return scheduler


def step(scheduler, executor):
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, executor.execute(plan))
    return plan


def decoding_then(scheduler, executor, *requests):
    """Request "a" prefills alone and starts decoding; then `requests` arrive."""
    scheduler.add_request(make_request("a", [1, 2, 3, 4], max_tokens=40))
    step(scheduler, executor)
    for request in requests:
        scheduler.add_request(request)


def test_prompt_chunks_shrink_to_fit_beside_decode_rows():
    capped, executor = seeded(make_scheduler(max_tokens=64, target_itl_ms=30)), FakeExecutor(4)
    decoding_then(capped, executor, make_request("b", list(range(10, 110)), max_tokens=2))
    sizes = [step(capped, executor).num_scheduled_tokens for _ in range(6)]
    assert sizes == [{"a": 1, "b": 19}] * 5 + [{"a": 1, "b": 5}]
    assert capped.get_stats()["foveal:itl_capped_steps_total"] == 6

    plain, executor = make_scheduler(max_tokens=64), FakeExecutor(4)
    decoding_then(plain, executor, make_request("b", list(range(10, 110)), max_tokens=2))
    assert step(plain, executor).num_scheduled_tokens == {"a": 1, "b": 63}


def test_no_cap_without_decode_rows_or_before_a_fit():
    scheduler, executor = seeded(make_scheduler(max_tokens=64, target_itl_ms=30)), FakeExecutor(4)
    scheduler.add_request(make_request("b", list(range(10, 110)), max_tokens=2))
    assert step(scheduler, executor).num_scheduled_tokens == {"b": 64}  # nobody decodes yet

    unfitted, executor = make_scheduler(max_tokens=64, target_itl_ms=30), FakeExecutor(4)
    decoding_then(unfitted, executor, make_request("b", list(range(10, 110)), max_tokens=2))
    assert step(unfitted, executor).num_scheduled_tokens == {"a": 1, "b": 63}
    assert unfitted.get_stats()["foveal:itl_capped_steps_total"] == 0


def test_an_encoding_is_charged_against_the_prompt_room():
    scheduler, executor = seeded(make_scheduler(max_tokens=64, target_itl_ms=30)), FakeExecutor(4)
    prompt = image_prompt(before=3, length=8, after=20)
    decoding_then(scheduler, executor, make_request("b", prompt, max_tokens=2,
                                                    features=[image("h", 3, 8)]))
    # room 19: the 8-token image costs 16, so the first window stops before it (3 + 1 +
    # 16 > 19); the next encodes it with 3 tokens (1 + 16 <= 19, 19 - 16 = 3 left)
    plans = [step(scheduler, executor) for _ in range(3)]
    assert [p.num_scheduled_tokens["b"] for p in plans] == [3, 3, 19]
    assert [p.scheduled_encoder_inputs for p in plans] == [{}, {"b": [0]}, {}]
    assert [p.num_encoder_tokens for p in plans] == [0, 8, 0]
    assert executor.encode_counts == {"h": 1}


def test_an_image_over_the_target_runs_in_a_progress_step_of_its_own():
    scheduler, executor = seeded(make_scheduler(max_tokens=64, target_itl_ms=30)), FakeExecutor(4)
    prompt = image_prompt(before=3, length=40, after=4)  # the encoding alone costs 80 tokens
    decoding_then(scheduler, executor, make_request("b", prompt, max_tokens=2,
                                                    features=[image("h", 3, 40)]))
    plans = [step(scheduler, executor) for _ in range(5)]
    # held: 3 tokens, then none (1 + 80 > 19); the progress step: the window through
    # the image's first token, encoded uncharged; then held steps again
    assert [p.num_scheduled_tokens.get("b", 0) for p in plans] == [3, 0, 1, 19, 19]
    assert [p.scheduled_encoder_inputs for p in plans] == [{}, {}, {"b": [0]}, {}, {}]
    assert scheduler.get_stats()["foveal:itl_capped_steps_total"] == 5
    assert executor.encode_counts == {"h": 1}


def test_a_target_below_the_decode_rows_cost_alternates_with_full_steps():
    # 10 ms + 1 ms a row is over a 10.5 ms target: no prompt token ever fits
    scheduler, executor = seeded(make_scheduler(max_tokens=64, target_itl_ms=10.5)), \
        FakeExecutor(4)
    decoding_then(scheduler, executor, make_request("b", list(range(10, 210)), max_tokens=2))
    sizes = [step(scheduler, executor).num_scheduled_tokens for _ in range(4)]
    assert sizes == [{"a": 1}, {"a": 1, "b": 63}] * 2


def test_a_bidirectional_span_is_charged_whole():
    scheduler, executor = seeded(make_scheduler(max_tokens=64, target_itl_ms=30)), FakeExecutor(4)
    prompt = image_prompt(before=1, length=6, after=10)
    feature = bidirectional_image("g", 1, ((0, 6),))  # encoding costs 12, the span needs 6 tokens
    decoding_then(scheduler, executor, make_request("b", prompt, max_tokens=2, features=[feature]))
    plans = [step(scheduler, executor) for _ in range(2)]
    # room 19: 12 + 1 + 6 = 19 fits: through the span (7 tokens), no further (19 - 12 = 7)
    assert [p.num_scheduled_tokens["b"] for p in plans] == [7, 10]
    assert plans[0].scheduled_encoder_inputs == {"b": [0]}


def test_decode_rows_behind_a_prefilling_request_are_not_starved():
    # at 16 tokens a step the time cap (20) does not bind: decode rows come first anyway
    scheduler, executor = seeded(make_scheduler(max_tokens=16, target_itl_ms=30)), FakeExecutor(4)
    # "p" stops before its image (4 + 16 > 15), so "e" gets in behind it and decodes
    decoding_then(scheduler, executor,
                  make_request("p", image_prompt(3, 8, 60), features=[image("h", 3, 8)]),
                  make_request("e", [5, 6], max_tokens=8))
    plans = [step(scheduler, executor) for _ in range(6)]
    assert [p.num_scheduled_tokens for p in plans] == [
        {"a": 1, "p": 3, "e": 2},
        {"a": 1, "e": 1},  # "p"'s image (1 + 16) does not fit beside two rows (14 left)
        {"a": 1, "p": 1, "e": 1},  # so a progress step takes its first token, encodes it
        {"a": 1, "p": 14, "e": 1}, {"a": 1, "p": 14, "e": 1}, {"a": 1, "p": 14, "e": 1}]
    assert plans[2].scheduled_encoder_inputs == {"p": [0]}

    plain, executor = make_scheduler(max_tokens=16), FakeExecutor(4)
    decoding_then(plain, executor, make_request("p", image_prompt(3, 8, 60),
                                                features=[image("h", 3, 8)]))
    step(plain, executor)
    plain.add_request(make_request("e", [5, 6], max_tokens=8))
    assert step(plain, executor).num_scheduled_tokens == {"a": 1, "p": 15}  # "e" waits


@pytest.mark.parametrize("num_blocks", [64, 14])
def test_same_outputs_and_everything_returned_with_the_cap(num_blocks):
    def run(target_itl_ms):
        scheduler = make_scheduler(num_blocks=num_blocks, max_tokens=32,
                                   target_itl_ms=target_itl_ms)
        seeded(scheduler)
        executor = FakeExecutor(4)
        scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=12))
        scheduler.add_request(make_request("b", image_prompt(2, 12, 9),
                                           features=[image("x", 2, 12)], max_tokens=6))
        scheduler.add_request(make_request("c", list(range(200, 240)), max_tokens=9))
        scheduler.add_request(make_request("d", image_prompt(5, 30, 3),
                                           features=[image("y", 5, 30)], max_tokens=5))
        results = run_to_completion(scheduler, executor)
        assert_all_returned(scheduler)
        return results, scheduler.get_stats()

    (capped, stats), (plain, _) = run(30), run(None)
    assert capped == plain
    assert stats["foveal:itl_capped_steps_total"] > 0
    if num_blocks == 14:
        assert stats["foveal:num_preemptions_total"] > 0


def test_the_engine_core_times_each_step_into_the_model(monkeypatch):
    clock = [0.0]

    class TimedExecutor(FakeExecutor):
        def execute(self, plan, mm_payloads=None):
            clock[0] += BASE + PER_TOKEN * plan.total_num_scheduled_tokens
            return super().execute(plan, mm_payloads)

    monkeypatch.setattr("foveal.engine.core.time.perf_counter", lambda: clock[0])
    core = EngineCore(make_scheduler(max_tokens=64, target_itl_ms=30), TimedExecutor(4))
    core.add_request(make_request("a", [1, 2, 3, 4], max_tokens=60))
    for index, length in enumerate([60, 10, 80, 5, 70, 3]):  # steps of varied sizes
        core.step()
        first = 100 * (index + 1)  # no prefix shared with the others
        core.add_request(make_request(f"r{index}", list(range(first, first + length)),
                                      max_tokens=2))
    core.step()
    assert core.scheduler.step_cost.coefficients == pytest.approx((BASE, PER_TOKEN, 0.0))
    core.add_request(make_request("z", list(range(300, 500)), max_tokens=2))
    while core.scheduler.waiting:
        core.step()
    # with the fit in hand the cap holds: 20 tokens a step, "a"'s decode row among them
    assert core.scheduler.schedule().total_num_scheduled_tokens == 20


def test_sized_steps_settle_at_the_target_when_the_line_underestimates_them(monkeypatch):
    """Mixed steps cost 1.5x the line through the others: the fit and its
    correction bring the steps sized to 30 ms back to it within a few steps."""
    clock, sized = [0.0], []

    class ConcaveExecutor(FakeExecutor):
        def execute(self, plan, mm_payloads=None):
            seconds = BASE + PER_TOKEN * plan.total_num_scheduled_tokens
            seconds *= 1.5 if len(plan.num_scheduled_tokens) > 1 else 1.0
            clock[0] += seconds
            if plan.sized_to_target:
                sized.append(seconds)
            return super().execute(plan, mm_payloads)

    monkeypatch.setattr("foveal.engine.core.time.perf_counter", lambda: clock[0])
    core = EngineCore(seeded(make_scheduler(max_tokens=64, target_itl_ms=30)), ConcaveExecutor(4))
    core.add_request(make_request("a", [1, 2, 3, 4], max_tokens=200))
    core.step()
    for index in range(6):
        first = 1000 * (index + 1)
        core.add_request(make_request(f"p{index}", list(range(first, first + 120)), max_tokens=1))
    while core.scheduler.waiting or len(core.scheduler.running) > 1:
        core.step()
    assert sized[0] == pytest.approx(0.045)  # 20 tokens on the line's word
    assert all(0.025 <= seconds <= 0.0305 for seconds in sized[5:-1])  # the last: what was left


def test_the_correction_divides_the_target():
    class Corrected(StepCostModel):
        correction = 1.5

    scheduler, executor = make_scheduler(max_tokens=64, target_itl_ms=30), FakeExecutor(4)
    scheduler.step_cost = Corrected()
    seeded(scheduler)
    decoding_then(scheduler, executor, make_request("b", list(range(10, 110)), max_tokens=2))
    # (30 ms / 1.5 - 10 ms) / 1 ms per token = 10 tokens, the decode row among them
    assert step(scheduler, executor).num_scheduled_tokens == {"a": 1, "b": 9}


def test_the_option_from_the_command_line_and_its_bad_values():
    import argparse

    from foveal.engine_args import EngineArgs
    from foveal.entrypoints.cli_args import add_engine_args, engine_kwargs
    from foveal.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--target-itl-ms", "250"]))["target_itl_ms"] == 250.0
    assert engine_kwargs(parser.parse_args([]))["target_itl_ms"] is None
    for bad in (0, -5.0, float("nan")):
        with pytest.raises(ConfigError, match="target_itl_ms"):  # before the model is read
            EngineArgs(model="/nonexistent", target_itl_ms=bad).create_engine_config()
