"""Prefix cache, encoder cache, processor cache and KV offload tier, end to end:
no false hits, multi-turn reuse, eviction under small pools, no leaks."""
from __future__ import annotations

import pytest
from PIL import Image

from foveal import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
BLOCK = 16


def make_llm(checkpoint: str, **kwargs) -> LLM:
    options = dict(max_model_len=512, kv_cache_memory_bytes=1 << 20, max_num_batched_tokens=256)
    return LLM(model=checkpoint, **{**options, **kwargs})


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def llm_off(checkpoint) -> LLM:
    return make_llm(checkpoint, enable_prefix_caching=False)


def image(color: int, size=(56, 56)) -> Image.Image:
    return Image.new("RGB", size, (color, 90, 200 - color))


def user(text: str, *images: Image.Image) -> dict:
    parts = [{"type": "image_pil", "image_pil": img} for img in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def fingerprint(output) -> list:
    """Greedy tokens and their logprobs: differs when any input differs; compare
    across engines with `same`, which allows float noise from other chunking."""
    completion = output.outputs[0]
    return [(t, step[t].logprob) for t, step in zip(completion.token_ids, completion.logprobs)]


def same(outputs, expected) -> bool:
    return all([t for t, _ in fingerprint(a)] == [t for t, _ in fingerprint(b)]
               and [p for _, p in fingerprint(a)] == pytest.approx(
                   [p for _, p in fingerprint(b)], abs=1e-4)
               for a, b in zip(outputs, expected, strict=True))


def run(llm: LLM, conversations, **kwargs) -> list:
    return llm.chat(conversations, GREEDY, use_tqdm=False, **kwargs)


def metric(llm: LLM, name: str) -> float:
    return llm.get_metrics()[f"foveal:{name}"]


def assert_no_references_left(llm: LLM) -> None:
    scheduler = llm.llm_engine.core.scheduler
    assert all(scheduler.kv.ref_count(b) == 0 for b in range(scheduler.kv.num_blocks))
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_blocks
    assert scheduler.encoder._entries and all(
        not entry.request_ids for entry in scheduler.encoder._entries.values())


def test_image_differing_in_one_pixel_is_not_a_false_hit(checkpoint, llm_off):
    llm = make_llm(checkpoint)
    changed = image(40)
    changed.putpixel((30, 30), (41, 90, 160))
    conversations = [[user("Describe.", image(40))], [user("Describe.", changed)]]
    first, second = [run(llm, [c])[0] for c in conversations]
    image_start = second.prompt_token_ids.index(llm.llm_engine.config.model.image_token_id)
    assert second.num_cached_tokens <= image_start
    assert fingerprint(first) != fingerprint(second)
    assert same([first, second], [run(llm_off, [c])[0] for c in conversations])


def test_other_max_pixels_is_not_a_false_hit(checkpoint, llm_off):
    llm = make_llm(checkpoint)
    picture = image(70, (112, 112))
    small = {"max_pixels": 56 * 56}
    on = [run(llm, [[user("Describe.", picture)]])[0],
          run(llm, [[user("Describe.", picture)]], mm_processor_kwargs=small)[0]]
    off = [run(llm_off, [[user("Describe.", picture)]])[0],
           run(llm_off, [[user("Describe.", picture)]], mm_processor_kwargs=small)[0]]
    assert len(on[0].prompt_token_ids) != len(on[1].prompt_token_ids)
    assert metric(llm, "encoder_items_total") == 2
    assert same(on, off)


def test_turn_two_runs_no_encoder_and_computes_only_new_tokens(checkpoint, llm_off):
    llm = make_llm(checkpoint)
    turn1 = [user("What is this?", image(17))]
    first = run(llm, [turn1])[0]
    items = metric(llm, "encoder_items_total")
    turn2 = turn1 + [{"role": "assistant", "content": first.outputs[0].text},
                     user("And its colour?")]
    second = run(llm, [turn2])[0]
    assert metric(llm, "encoder_items_total") == items
    assert second.num_cached_tokens >= len(first.prompt_token_ids) // BLOCK * BLOCK
    assert same([second], run(llm_off, [turn2]))


def test_same_image_in_another_conversation_hits_the_encoder_cache_only(checkpoint):
    llm = make_llm(checkpoint)
    run(llm, [[user("What is this?", image(23))]])
    items, hits = metric(llm, "encoder_items_total"), metric(llm, "encoder_cache_hits_total")
    moved = [{"role": "system", "content": "You are terse and exact in every answer."},
             user("Compare it with nothing else.", image(23))]
    output = run(llm, [moved])[0]
    image_start = output.prompt_token_ids.index(llm.llm_engine.config.model.image_token_id)
    assert output.num_cached_tokens <= image_start
    assert (output.encoder_cache_queries, output.encoder_cache_hits) == (1, 1)
    assert metric(llm, "encoder_items_total") == items
    assert metric(llm, "encoder_cache_hits_total") == hits + 1


def test_image_whose_kv_was_evicted_is_not_encoded_again(checkpoint):
    llm = make_llm(checkpoint, max_model_len=128, kv_cache_memory_bytes=10 * 8192)
    conversation = [user("What is this?", image(5))]
    run(llm, [conversation])
    for color in range(100, 106):  # other prompts reuse every block
        run(llm, [[user(f"Other {color}.", image(color))]])
    items = metric(llm, "encoder_items_total")
    again = run(llm, [conversation])[0]
    image_start = again.prompt_token_ids.index(llm.llm_engine.config.model.image_token_id)
    assert again.num_cached_tokens <= image_start  # only the shared system prompt hits
    assert metric(llm, "encoder_items_total") == items


def test_small_pools_evict_yet_outputs_match_and_nothing_leaks(checkpoint, llm_off):
    llm = make_llm(checkpoint, max_model_len=256, kv_cache_memory_bytes=24 * 8192,
                   encoder_cache_size=40, processor_cache_size=200_000)
    conversations = [[user(f"Look {i % 3}.", image(10 * (i % 4)), image(7 * (i % 5)))]
                     for i in range(8)]
    on = run(llm, conversations)
    assert same(on, run(llm_off, conversations))
    assert metric(llm, "prefix_cache_hits_total") > 0
    assert metric(llm, "encoder_cache_hits_total") > 0
    assert_no_references_left(llm)
    scheduler = llm.llm_engine.core.scheduler
    assert scheduler.encoder.num_used <= 40
    assert 0 < metric(llm, "processor_cache_bytes") <= 200_000


def test_abort_drops_every_cache_reference(checkpoint):
    llm = make_llm(checkpoint)
    engine = llm.llm_engine
    for request_id in ("a", "b"):
        engine.add_request(request_id, {"prompt": "<|vision_start|><|image_pad|><|vision_end|>hi",
                                        "multi_modal_data": {"image": image(60)}},
                           SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request(["a", "b"])
    assert_no_references_left(llm)


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_offload_tier_serves_a_repeat_after_forced_eviction(checkpoint, llm_off, tier, tmp_path):
    llm = make_llm(checkpoint, max_model_len=128, kv_cache_memory_bytes=10 * 8192,
                   kv_offload=tier, kv_offload_path=str(tmp_path), kv_offload_bytes=64 * 8192)
    conversation = [user("What is in this picture, in detail?", image(9))]
    first = run(llm, [conversation])[0]
    for color in range(120, 126):
        run(llm, [[user(f"Other {color}.", image(color))]])
    assert metric(llm, "kv_offload_bytes") > 0
    again = run(llm, [conversation])[0]
    assert metric(llm, "kv_offload_hits_total") > 0
    assert again.num_cached_tokens >= len(first.prompt_token_ids) // BLOCK * BLOCK - BLOCK
    assert same([again, first], run(llm_off, [conversation, conversation]))


def test_cache_salt_keeps_prefixes_apart(checkpoint):
    llm = make_llm(checkpoint)
    prompt = {"prompt": "<|vision_start|><|image_pad|><|vision_end|>" + "salted words " * 8,
              "multi_modal_data": {"image": image(33)}}
    llm.generate({**prompt, "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)
    other = llm.generate({**prompt, "cache_salt": "tenant-b"}, GREEDY, use_tqdm=False)[0]
    same = llm.generate({**prompt, "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)[0]
    assert other.num_cached_tokens == 0
    assert same.num_cached_tokens >= BLOCK
