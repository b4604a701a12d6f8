"""Speculative decoding end to end, n-gram and EAGLE-3 (a head trained here by
`train_eagle` on the tiny model): greedy outputs token-identical to decoding
without it, with images, chunked prefill, prefix-cache hits, preemption,
quantized KV and stop strings inside a draft; every block returned after
rejections; the per-request opt-out; metrics; bad configurations."""
from __future__ import annotations

import pytest

from foveal import LLM, SamplingParams
from foveal.errors import ConfigError
from tests.e2e.test_multimodal_caching import image, user

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def eagle_head(checkpoint, tmp_path_factory) -> str:
    """An EAGLE-3 head trained for the tiny model on its own answers (seconds)."""
    from foveal.eagle_train.train import EagleTrainConfig, train_eagle

    out = tmp_path_factory.mktemp("eagle3-head")
    train_eagle(checkpoint, out, EagleTrainConfig(num_prompts=16, max_tokens=32, steps=80,
                                                  batch_size=4, draft_vocab_size=384))
    return str(out)


@pytest.fixture(scope="module", params=["ngram", "eagle3"])
def speculative(request) -> dict:
    if request.param == "ngram":
        return NGRAM
    return {"method": "eagle3", "num_speculative_tokens": 3,
            "model": request.getfixturevalue("eagle_head")}


def make_llm(checkpoint: str, speculative: dict | None, **kwargs) -> LLM:
    options = dict(max_model_len=512, kv_cache_memory_bytes=1 << 21, max_num_batched_tokens=256)
    if speculative:
        options["speculative_config"] = speculative
    return LLM(model=checkpoint, **{**options, **kwargs})


def conversations() -> list:
    """Image and text requests whose prompts repeat phrases (what n-gram drafts feed on)."""
    text = "say the words again: red green blue, red green blue, red green"
    return ([[user(f"{text} {i}", image(30 * i))] for i in range(3)]
            + [[{"role": "user", "content": f"{text} and more {i}"}] for i in range(2)])


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def metric(llm: LLM, name: str) -> float:
    return llm.get_metrics()[f"foveal:{name}"]


def assert_all_blocks_returned(llm: LLM) -> None:
    kv = llm.llm_engine.core.scheduler.kv
    assert kv.num_free_blocks == kv.num_usable_blocks  # all but a hybrid pool's null block
    assert all(kv.ref_count(block) == 0 for block in range(kv.num_blocks)
               if block != kv.null_block)


@pytest.fixture(scope="module")
def expected(checkpoint) -> list[list[int]]:
    return tokens(make_llm(checkpoint, None).chat(conversations(), GREEDY, use_tqdm=False))


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 16},  # chunked prefill through the images
    {"kv_cache_dtype": "int8"},
], ids=["batch", "chunked", "int8-kv"])
def test_greedy_tokens_are_identical_with_speculation(checkpoint, speculative, expected, options):
    if options.get("kv_cache_dtype"):
        expected = tokens(make_llm(checkpoint, None, **options).chat(
            conversations(), GREEDY, use_tqdm=False))
    llm = make_llm(checkpoint, speculative, **options)
    outputs = llm.chat(conversations(), GREEDY, use_tqdm=False)
    assert tokens(outputs) == expected
    assert metric(llm, "spec_decode_num_accepted_tokens_total") > 0
    assert metric(llm, "spec_decode_num_draft_tokens_total") > \
        metric(llm, "spec_decode_num_accepted_tokens_total")  # some rejections happened
    assert metric(llm, "spec_decode_mean_accepted_length") > 1
    assert_all_blocks_returned(llm)
    for output in outputs:  # logprobs for every kept token, drafts included
        assert len(output.outputs[0].logprobs) == len(output.outputs[0].token_ids)


def test_preemption_and_prefix_hits_keep_the_tokens(checkpoint, speculative):
    longer = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    small = dict(max_model_len=160, kv_cache_memory_bytes=14 * 8192)  # 14 blocks
    expected = tokens(make_llm(checkpoint, None, **small).chat(conversations(), longer,
                                                                use_tqdm=False))
    if speculative["method"] == "eagle3":  # the head's KV takes 1/3 of the budget here
        small["kv_cache_memory_bytes"] = 21 * 8192
    llm = make_llm(checkpoint, speculative, **small)
    assert llm.llm_engine.core.scheduler.kv.num_blocks == 14
    assert tokens(llm.chat(conversations(), longer, use_tqdm=False)) == expected
    assert metric(llm, "num_preemptions_total") > 0
    assert tokens(llm.chat(conversations(), longer, use_tqdm=False)) == expected  # prefix hits
    assert metric(llm, "prefix_cache_hits_total") > 0
    assert_all_blocks_returned(llm)


def run_stop(outputs, tokenizer) -> tuple[int, str]:
    """(conversation index, stop string): two copies of a token that repeats
    from position 8 on (n-gram drafts are accepted in such runs), where that
    text first shows up in the answer."""
    for index, output in enumerate(outputs):
        ids, text = output.outputs[0].token_ids, output.outputs[0].text
        for i in range(8, len(ids) - 4):
            piece = tokenizer.decode([ids[i]])
            if len(set(ids[i:i + 4])) == 1 and piece.isprintable() and piece.strip() \
                    and text.find(piece * 2) == len(tokenizer.decode(ids[:i])):
                return index, piece * 2
    raise AssertionError("no repeated run to stop in")


def test_stop_string_inside_an_accepted_draft_ends_the_output_there(checkpoint, speculative):
    plain = make_llm(checkpoint, None)
    index, stop = run_stop(plain.chat(conversations(), GREEDY, use_tqdm=False),
                           plain.get_tokenizer())
    conversation = conversations()[index:index + 1]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
    without = plain.chat(conversation, params, use_tqdm=False)[0].outputs[0]
    llm = make_llm(checkpoint, speculative)
    with_spec = llm.chat(conversation, params, use_tqdm=False)[0].outputs[0]
    assert without.finish_reason == "stop" and without.stop_reason == stop
    assert (with_spec.text, with_spec.token_ids, with_spec.finish_reason) == \
        (without.text, without.token_ids, without.finish_reason)
    assert metric(llm, "spec_decode_num_accepted_tokens_total") > 0
    assert_all_blocks_returned(llm)


def test_request_that_opts_out_gets_no_drafts(checkpoint, speculative, expected):
    llm = make_llm(checkpoint, speculative)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                            speculative_decoding=False)
    assert tokens(llm.chat(conversations(), params, use_tqdm=False)) == expected
    assert metric(llm, "spec_decode_num_draft_tokens_total") == 0


def test_sampling_with_speculation_runs_seeded_and_reproducibly(checkpoint, speculative):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, ignore_eos=True, seed=3)
    first = tokens(make_llm(checkpoint, speculative).chat(conversations(), params, use_tqdm=False))
    again = tokens(make_llm(checkpoint, speculative).chat(conversations(), params, use_tqdm=False))
    assert first == again and all(len(t) == 30 for t in first)


@pytest.mark.parametrize("config, message", [
    ({"method": "lookahead"}, "unknown"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "needs a draft head"),
    ({"method": "eagle3", "model": "/nonexistent"}, "no config.json"),
    ({"method": "ngram", "model": "/some/head"}, "takes no draft"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 4096}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup"),
    ({"method": "ngram", "draft_tensor_parallel_size": 2}, "unknown speculative_config key"),
    ({"num_speculative_tokens": 2}, "needs a 'method'"),
])
def test_bad_speculative_config_is_a_config_error(checkpoint, config, message):
    with pytest.raises(ConfigError, match=message):
        LLM(model=checkpoint, max_model_len=512, speculative_config=config)
