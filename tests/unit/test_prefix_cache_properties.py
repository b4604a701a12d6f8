"""Property: with prefix, encoder, processor caches and the offload tier on,
under pools small enough to evict, outputs equal those with caching off.

Random multi-turn conversations repeat, swap and reorder a few tiny images; the
cached engine keeps its state across examples, so later ones hit (and evict)
what earlier ones left behind.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from foveal import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=1)
IMAGES = [Image.new("RGB", size, color) for size, color in [
    ((28, 28), (200, 10, 10)), ((56, 28), (10, 200, 10)), ((56, 56), (10, 10, 200)),
    ((28, 56), (120, 120, 0))]]
WORDS = ["look", "compare", "which", "colour", "left", "again"]

turns = st.lists(st.tuples(st.lists(st.integers(0, len(IMAGES) - 1), max_size=2),
                           st.lists(st.sampled_from(WORDS), min_size=1, max_size=3)),
                 min_size=1, max_size=3)


@pytest.fixture(scope="module")
def engines(tiny_checkpoints):
    common = dict(model=tiny_checkpoints("tiny-qwen2-vl"), max_model_len=256,
                  max_num_batched_tokens=64, limit_mm_per_prompt={"image": 6})
    cached = LLM(**common, kv_cache_memory_bytes=20 * 8192, encoder_cache_size=12,
                 processor_cache_size=30_000, kv_offload="cpu", kv_offload_bytes=24 * 8192)
    uncached = LLM(**common, kv_cache_memory_bytes=1 << 20, enable_prefix_caching=False,
                   processor_cache_size=0)
    return cached, uncached


def conversation_prefixes(spec) -> list[list[dict]]:
    """One prompt per turn: the conversation so far, ending in a user message."""
    messages: list[dict] = []
    prompts = []
    for image_ids, words in spec:
        content = [{"type": "image_pil", "image_pil": IMAGES[i]} for i in image_ids]
        messages.append({"role": "user", "content": [*content,
                                                     {"type": "text", "text": " ".join(words)}]})
        prompts.append(list(messages))
        messages.append({"role": "assistant", "content": "fine"})
    return prompts


def outputs(llm: LLM, prompts) -> list[tuple[list[int], list[float]]]:
    results = []
    for prompt in prompts:  # one by one: a later turn can hit the earlier one
        completion = llm.chat(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
        results.append((list(completion.token_ids),
                        [step[t].logprob for t, step in zip(completion.token_ids,
                                                            completion.logprobs)]))
    return results


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=turns)
def test_outputs_with_caching_equal_outputs_without(engines, spec):
    cached, uncached = engines
    prompts = conversation_prefixes(spec)
    got, expected = outputs(cached, prompts), outputs(uncached, prompts)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, logprobs), (_, reference) in zip(got, expected):
        assert logprobs == pytest.approx(reference, abs=1e-4)
    scheduler = cached.llm_engine.core.scheduler
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
