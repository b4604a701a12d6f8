"""Scheduler behaviour, driven by a fake executor that checks every plan."""
from __future__ import annotations

import zlib
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foveal.config import CacheConfig, SchedulerConfig
from foveal.engine.plan import ModelRunnerOutput, StepPlan
from foveal.engine.request import Request
from foveal.engine.scheduler import Scheduler, build_scheduler
from foveal.errors import ContextLengthError, InvalidRequestError
from foveal.multimodal.inputs import MMFeature, PlaceholderRange
from foveal.sampling_params import SamplingParams

IMAGE_TOKEN = 7


def history_token(history: list[int]) -> int:
    return 100 + zlib.crc32(repr(history).encode()) % 900


class FakeExecutor:
    """Simulates workers: KV slots hold (token, mm_hash) so a wrong prefix hit,
    a missing encoder input or a short block table fails an assert."""

    def __init__(self, block_size: int, next_token=history_token):
        self.block_size = block_size
        self.next_token = next_token
        self.tokens: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.features: dict[str, list[MMFeature]] = {}
        self.kv: dict[int, tuple] = {}
        self.encoder_cache: set[str] = set()
        self.encode_counts: Counter = Counter()
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan, mm_payloads=None) -> ModelRunnerOutput:
        self.plans.append(plan)
        for rid in plan.finished_request_ids:
            for table in (self.tokens, self.computed, self.blocks, self.features):
                table.pop(rid, None)
        self.encoder_cache.difference_update(plan.freed_mm_hashes)
        for new in plan.new_requests:
            self.tokens[new.request_id] = list(new.token_ids)
            self.computed[new.request_id] = new.num_computed_tokens
            self.blocks[new.request_id] = list(new.block_ids[0])
            self.features[new.request_id] = new.mm_features
        for cached in plan.cached_requests:
            assert self.computed[cached.request_id] == cached.num_computed_tokens
            self.blocks[cached.request_id] += cached.new_block_ids[0]
        output = ModelRunnerOutput()
        for rid, indices in plan.scheduled_encoder_inputs.items():
            for index in indices:
                mm_hash = self.features[rid][index].mm_hash
                self.encode_counts[mm_hash] += 1
                self.encoder_cache.add(mm_hash)
                output.num_encoder_items_run += 1
        for rid, num_new in plan.num_scheduled_tokens.items():
            self._forward(rid, num_new, output)
        return output

    def _expected_slot(self, rid: str, position: int) -> tuple:
        mm = [f.mm_hash for f in self.features[rid]
              if f.placeholder.offset <= position < f.placeholder.end]
        return (self.tokens[rid][position], tuple(mm))

    def _slot(self, rid: str, position: int) -> int:
        return self.blocks[rid][position // self.block_size] * self.block_size + \
            position % self.block_size

    def _forward(self, rid: str, num_new: int, output: ModelRunnerOutput) -> None:
        start, tokens = self.computed[rid], self.tokens[rid]
        end = start + num_new
        assert 0 < num_new and end <= len(tokens)
        assert len(self.blocks[rid]) * self.block_size >= end
        for position in range(start):
            assert self.kv[self._slot(rid, position)] == self._expected_slot(rid, position)
        for feature in self.features[rid]:
            if feature.placeholder.offset < end and feature.placeholder.end > start:
                assert feature.mm_hash in self.encoder_cache
        for position in range(start, end):
            self.kv[self._slot(rid, position)] = self._expected_slot(rid, position)
        self.computed[rid] = end
        if end == len(tokens):
            token = self.next_token(tokens)
            tokens.append(token)
            output.sampled_token_ids[rid] = [token]


def image(mm_hash: str, offset: int, length: int) -> MMFeature:
    return MMFeature("image", mm_hash, PlaceholderRange(offset, length))


def make_request(rid: str, prompt: list[int], max_tokens: int = 4, features=(),
                 cache_salt=None, **params) -> Request:
    return Request(rid, prompt, list(features), SamplingParams(max_tokens=max_tokens, **params),
                   arrival_time=0.0, cache_salt=cache_salt)


def image_prompt(before: int, length: int, after: int, text_start: int = 1) -> list[int]:
    return list(range(text_start, text_start + before)) + [IMAGE_TOKEN] * length + \
        list(range(text_start + 50, text_start + 50 + after))


def make_scheduler(num_blocks=64, block_size=4, max_tokens=16, max_seqs=8, max_len=256,
                   encoder_budget=64, encoder_cache=128, prefix=True,
                   target_itl_ms=None) -> Scheduler:
    return build_scheduler(
        SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                        max_model_len=max_len, encoder_compute_budget=encoder_budget,
                        target_itl_ms=target_itl_ms),
        CacheConfig(block_size=block_size, enable_prefix_caching=prefix,
                    encoder_cache_size=encoder_cache),
        num_blocks)


def run_to_completion(scheduler: Scheduler, executor: FakeExecutor, max_steps=1000):
    """request id -> (output token ids, finish reason)."""
    results: dict[str, tuple[list[int], str]] = {}
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return results
        plan = scheduler.schedule()
        for output in scheduler.update_from_output(plan, executor.execute(plan)):
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.finished:
                results[output.request_id] = (tokens.get(output.request_id, []),
                                              output.finish_reason)
    raise AssertionError("requests did not finish")


def assert_all_returned(scheduler: Scheduler) -> None:
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert scheduler.kv.usage == 0.0
    assert all(scheduler.encoder.num_refs(h) == 0 for h in list(scheduler.encoder._entries))


def test_one_rule_mixes_decode_and_chunked_prefill_in_one_step():
    scheduler, executor = make_scheduler(max_tokens=10), FakeExecutor(4)
    scheduler.add_request(make_request("a", [1, 2, 3, 4]))
    scheduler.add_request(make_request("b", list(range(10, 30))))
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"a": 4, "b": 6}
    scheduler.update_from_output(plan, executor.execute(plan))
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"a": 1, "b": 9}
    assert [c.request_id for c in plan.cached_requests] == ["a", "b"]
    assert not plan.new_requests


def test_chunked_prefill_across_image_encodes_it_exactly_once():
    scheduler, executor = make_scheduler(max_tokens=5), FakeExecutor(4)
    scheduler.add_request(make_request("a", image_prompt(6, 16, 6), features=[image("h1", 6, 16)]))
    results = run_to_completion(scheduler, executor)
    assert results["a"][1] == "length"
    assert executor.encode_counts == {"h1": 1}
    encode_steps = [p for p in executor.plans if p.scheduled_encoder_inputs]
    assert len(encode_steps) == 1 and encode_steps[0].scheduled_encoder_inputs == {"a": [0]}
    assert scheduler.get_stats()["foveal:encoder_items_total"] == 1
    assert scheduler.get_stats()["foveal:visual_tokens_total"] == 16
    assert_all_returned(scheduler)


def test_encoder_compute_budget_cuts_window_before_item():
    scheduler = make_scheduler(max_tokens=64, encoder_budget=16)
    scheduler.add_request(make_request("a", image_prompt(2, 16, 2), features=[image("ha", 2, 16)]))
    scheduler.add_request(make_request("b", image_prompt(4, 16, 2, 200),
                                       features=[image("hb", 4, 16)]))
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"a": 20, "b": 4}
    assert plan.scheduled_encoder_inputs == {"a": [0]}


def test_encoder_cache_space_cuts_window_and_request_waits():
    scheduler, executor = make_scheduler(max_tokens=64, encoder_cache=16), FakeExecutor(4)
    scheduler.add_request(make_request("a", image_prompt(2, 16, 2), features=[image("ha", 2, 16)]))
    scheduler.add_request(make_request("b", image_prompt(0, 16, 2, 200),
                                       features=[image("hb", 0, 16)]))
    plan = scheduler.schedule()
    assert plan.num_scheduled_tokens == {"a": 20}  # b would get 0 tokens: not admitted
    scheduler.update_from_output(plan, executor.execute(plan))
    plan = scheduler.schedule()  # a consumed its image: the entry is evictable now
    assert plan.num_scheduled_tokens == {"a": 1, "b": 18}
    assert plan.freed_mm_hashes == ["ha"]


def test_shared_image_across_requests_is_encoded_once():
    scheduler, executor = make_scheduler(max_tokens=8), FakeExecutor(4)
    for rid, start in (("a", 1), ("b", 300)):
        scheduler.add_request(make_request(rid, image_prompt(3, 12, 3, start),
                                           features=[image("same", 3, 12)]))
    run_to_completion(scheduler, executor)
    assert executor.encode_counts == {"same": 1}


def test_preempted_request_completes_with_same_tokens():
    prompts = {f"r{i}": list(range(10 * i + 1, 10 * i + 11)) for i in range(4)}
    outputs, computed = [], []
    for num_blocks in (64, 10):
        scheduler, executor = make_scheduler(num_blocks=num_blocks), FakeExecutor(4)
        for rid, prompt in prompts.items():
            scheduler.add_request(make_request(rid, prompt, max_tokens=12))
        outputs.append(run_to_completion(scheduler, executor))
        assert_all_returned(scheduler)
        computed.append(scheduler.get_stats()["foveal:computed_tokens_total"])
    assert scheduler.get_stats()["foveal:num_preemptions_total"] > 0
    assert outputs[0] == outputs[1]
    # every prompt token and every output but the last ran; recomputes come on top
    assert computed[0] == 4 * (10 + 11) and computed[1] > computed[0]


def test_prefix_cache_hit_on_repeated_prompt():
    scheduler, executor = make_scheduler(), FakeExecutor(4)
    prompt = list(range(1, 15))
    scheduler.add_request(make_request("a", prompt))
    run_to_completion(scheduler, executor)
    scheduler.add_request(make_request("b", prompt))
    plan = scheduler.schedule()
    assert plan.new_requests[0].num_computed_tokens == 12
    assert plan.num_scheduled_tokens == {"b": 2}
    stats = scheduler.get_stats()
    assert stats["foveal:prefix_cache_hits_total"] == 12
    assert stats["foveal:prefix_cache_queries_total"] == 28
    scheduler.update_from_output(plan, executor.execute(plan))
    run_to_completion(scheduler, executor)


def test_no_prefix_hit_when_mm_hash_differs_with_same_token_ids():
    scheduler, executor = make_scheduler(), FakeExecutor(4)
    prompt = image_prompt(4, 12, 4)
    scheduler.add_request(make_request("a", prompt, features=[image("cat", 4, 12)]))
    run_to_completion(scheduler, executor)
    scheduler.add_request(make_request("b", prompt, features=[image("dog", 4, 12)]))
    plan = scheduler.schedule()
    assert plan.new_requests[0].num_computed_tokens == 4  # only the text block before it
    scheduler.update_from_output(plan, executor.execute(plan))
    run_to_completion(scheduler, executor)  # executor asserts KV matches dog, not cat


def test_cache_salt_separates_prefix_cache():
    scheduler, executor = make_scheduler(), FakeExecutor(4)
    prompt = list(range(1, 15))
    scheduler.add_request(make_request("a", prompt, cache_salt="alice"))
    run_to_completion(scheduler, executor)
    scheduler.add_request(make_request("b", prompt, cache_salt="bob"))
    scheduler.add_request(make_request("c", prompt, cache_salt="alice"))
    plan = scheduler.schedule()
    assert [r.num_computed_tokens for r in plan.new_requests] == [0, 12]


def test_blocks_and_encoder_refs_return_after_finish_abort_and_fail():
    scheduler, executor = make_scheduler(max_tokens=8), FakeExecutor(4)
    for rid in ("done", "aborted", "failed"):
        scheduler.add_request(make_request(rid, image_prompt(2, 8, 6, len(rid)),
                                           features=[image(rid, 2, 8)]))
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, executor.execute(plan))
    scheduler.abort_requests(["aborted"])
    output = scheduler.fail_request("failed", "bad pixels")
    assert output.finish_reason == "error" and output.error == "bad pixels"
    run_to_completion(scheduler, executor)
    assert_all_returned(scheduler)
    stats = scheduler.get_stats()
    assert stats['foveal:request_success_total{finished_reason="abort"}'] == 1
    assert stats['foveal:request_success_total{finished_reason="error"}'] == 1
    assert stats['foveal:request_success_total{finished_reason="length"}'] == 1


def test_abort_mid_prefill_frees_blocks_and_tells_workers():
    scheduler, executor = make_scheduler(max_tokens=8), FakeExecutor(4)
    scheduler.add_request(make_request("a", list(range(1, 30))))
    plan = scheduler.schedule()
    scheduler.update_from_output(plan, executor.execute(plan))
    scheduler.abort_requests(["a"])
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    plan = scheduler.schedule()
    assert plan.finished_request_ids == {"a"} and plan.is_empty
    assert not scheduler.has_unfinished_requests()


def test_runner_failed_request_finishes_with_error_alone():
    scheduler, executor = make_scheduler(), FakeExecutor(4)
    scheduler.add_request(make_request("bad", [1, 2, 3]))
    scheduler.add_request(make_request("good", [4, 5, 6]))
    plan = scheduler.schedule()
    runner_output = executor.execute(plan)
    runner_output.failed_requests["bad"] = "encoder failed"
    runner_output.sampled_token_ids.pop("bad")
    outputs = {o.request_id: o for o in scheduler.update_from_output(plan, runner_output)}
    assert outputs["bad"].finish_reason == "error" and outputs["bad"].error == "encoder failed"
    assert outputs["good"].finish_reason is None
    assert "bad" not in scheduler.requests


def test_max_model_len_finishes_with_length():
    scheduler, executor = make_scheduler(max_len=12), FakeExecutor(4)
    scheduler.add_request(make_request("a", list(range(1, 11)), max_tokens=None))
    tokens, reason = run_to_completion(scheduler, executor)["a"]
    assert (len(tokens), reason) == (2, "length")


def test_eos_ignored_before_min_tokens():
    scheduler, executor = make_scheduler(), FakeExecutor(4, next_token=lambda history: 2)
    scheduler.add_request(make_request("a", [5, 6], max_tokens=10, min_tokens=3,
                                       eos_token_ids=(2,)))
    tokens, reason = run_to_completion(scheduler, executor)["a"]
    assert (tokens, reason) == ([2, 2, 2], "stop")


def test_stop_token_id_sets_stop_reason_and_ignore_eos():
    scheduler, executor = make_scheduler(), FakeExecutor(4, next_token=lambda history: 2)
    scheduler.add_request(make_request("a", [5, 6], max_tokens=3, ignore_eos=True,
                                       eos_token_ids=(2,)))
    scheduler.add_request(make_request("b", [5, 6], max_tokens=3, stop_token_ids=[2]))
    plan = scheduler.schedule()
    outputs = {o.request_id: o for o in scheduler.update_from_output(plan, executor.execute(plan))}
    assert outputs["a"].finish_reason is None
    assert (outputs["b"].finish_reason, outputs["b"].stop_reason) == ("stop", 2)


def test_admission_rejects_prompt_longer_than_max_model_len():
    scheduler = make_scheduler(max_len=8)
    with pytest.raises(ContextLengthError, match=r"9 tokens.*max_model_len is 8.*--max-model-len"):
        scheduler.add_request(make_request("a", list(range(9))))
    assert not scheduler.has_unfinished_requests()


def test_admission_rejects_request_larger_than_kv_pool():
    scheduler = make_scheduler(num_blocks=2, block_size=4)
    with pytest.raises(InvalidRequestError, match="--kv-cache-memory-bytes"):
        scheduler.add_request(make_request("a", list(range(6)), max_tokens=4))


def test_admission_rejects_item_larger_than_encoder_cache():
    scheduler = make_scheduler(encoder_cache=8)
    with pytest.raises(InvalidRequestError, match="16 visual tokens.*encoder cache holds 8"):
        scheduler.add_request(make_request("a", image_prompt(1, 16, 1),
                                           features=[image("big", 1, 16)]))


def test_admission_rejects_duplicate_request_id():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2]))
    with pytest.raises(InvalidRequestError, match="already in use"):
        scheduler.add_request(make_request("a", [1, 2]))


request_specs = st.lists(st.tuples(st.integers(0, 12), st.integers(0, 20), st.integers(1, 8),
                                   st.integers(0, 3)), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=request_specs, max_tokens=st.integers(1, 24), max_seqs=st.integers(1, 4),
       num_blocks=st.integers(12, 40), prefix=st.booleans())
def test_random_request_mixes_finish_within_budgets(specs, max_tokens, max_seqs, num_blocks,
                                                    prefix):
    scheduler = make_scheduler(num_blocks=num_blocks, max_tokens=max_tokens, max_seqs=max_seqs,
                               encoder_budget=16, encoder_cache=24, prefix=prefix)
    executor = FakeExecutor(4)
    for i, (text_len, image_len, gen_len, image_id) in enumerate(specs):
        image_len = min(image_len, 16)
        features = [image(f"img{image_id}", text_len, image_len)] if image_len else []
        prompt = image_prompt(text_len, image_len, 2, text_start=image_id)
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=gen_len,
                                           features=features))
    results = run_to_completion(scheduler, executor)
    assert {rid: len(tokens) for rid, (tokens, _) in results.items()} == \
        {f"r{i}": spec[2] for i, spec in enumerate(specs)}
    for plan in executor.plans:
        assert plan.total_num_scheduled_tokens <= max_tokens
        assert len(plan.num_scheduled_tokens) <= max_seqs
        encoded = sum(executor.features[rid][i].num_encoder_tokens if rid in executor.features
                      else 0 for rid, idx in plan.scheduled_encoder_inputs.items() for i in idx)
        assert encoded <= 16
    assert_all_returned(scheduler)
