"""Disaggregation inside the engine, without servers: a prefill core exports a
prompt's KV, a decode core continues from it; an encode core's embeddings
replace the tower on a prefill core. Greedy tokens equal one mixed engine's."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from foveal import SamplingParams
from foveal.engine.request import KVImport, Request
from foveal.engine_args import EngineArgs
from foveal.executor import build_engine_core
from foveal.input_processor import InputProcessor
from foveal.multimodal.inputs import ENCODED_KEY
from foveal.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the picture in "
          "words.<|im_end|>\n<|im_start|>assistant\n")


def engine_config(checkpoint: str, **kwargs):
    args = EngineArgs.from_kwargs(checkpoint, **{"max_model_len": 512,
                                                 "kv_cache_memory_bytes": 1 << 20, **kwargs})
    return args.create_engine_config()


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints):
    return tiny_checkpoints("tiny-qwen2-vl")


def image(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 255, (84, 112, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def make_request(config, request_id: str, prompt: dict, params=GREEDY) -> Request:
    processor = InputProcessor(config, Tokenizer.from_pretrained(config.model.path))
    return processor.process(request_id, prompt, params).request


def run(core, requests: list[Request]) -> dict[str, tuple[list[int], object]]:
    """request id -> (tokens, the final output's kv_export)."""
    for request in requests:
        core.add_request(request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    exports = {}
    while core.has_unfinished_requests():
        for output in core.step():
            tokens[output.request_id] += output.new_token_ids
            assert output.error is None, output.error
            if output.finished:
                exports[output.request_id] = output.kv_export
    return {rid: (tokens[rid], exports.get(rid)) for rid in tokens}


def prefill_then_decode(prefill, decode, config, prompt: dict, request_id: str) -> list[int]:
    first = make_request(config, request_id, prompt,
                         dataclasses.replace(GREEDY, max_tokens=1))
    first.export_kv = True
    [(_, blocks)] = run(prefill, [first]).values()
    assert blocks is not None
    second = make_request(config, request_id, prompt)
    second.kv_import = KVImport(second.num_prompt_tokens, blocks)
    [(tokens, _)] = run(decode, [second]).values()
    return tokens


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_decode_from_a_prefill_engines_kv_matches_one_engine(checkpoint, kv_cache_dtype):
    config = engine_config(checkpoint, kv_cache_dtype=kv_cache_dtype)
    mixed, prefill, decode = (build_engine_core(config) for _ in range(3))
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": image(seed)}} for seed in (1, 2)]
    expected = run(mixed, [make_request(config, f"m{i}", p) for i, p in enumerate(prompts)])
    for index, prompt in enumerate(prompts):
        tokens = prefill_then_decode(prefill, decode, config, prompt, f"r{index}")
        assert tokens == expected[f"m{index}"][0]
    stats = decode.get_stats()
    # all but the last prompt token came in; the decode engine never ran the tower
    assert stats["foveal:kv_imported_tokens_total"] == sum(
        make_request(config, "x", p).num_prompt_tokens - 1 for p in prompts)
    assert stats["foveal:encoder_items_total"] == 0
    assert prefill.get_stats()["foveal:kv_exported_tokens_total"] > 0
    for core in (prefill, decode):  # nothing held once the requests are done
        assert core.scheduler.kv.num_free_blocks == core.scheduler.kv.num_blocks


def test_decode_engine_prefix_hit_and_import_combine(checkpoint):
    """A second turn on the decode engine: its own prefix cache covers the first
    blocks, the import the rest."""
    config = engine_config(checkpoint)
    mixed, prefill, decode = (build_engine_core(config) for _ in range(3))
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": image(3)}}
    prefill_then_decode(prefill, decode, config, prompt, "t1")
    longer = {"prompt": PROMPT + "It shows noise.<|im_end|>\n<|im_start|>user\nMore?<|im_end|>\n"
                                 "<|im_start|>assistant\n", "multi_modal_data": prompt[
                                     "multi_modal_data"]}
    expected = run(mixed, [make_request(config, "m", longer)])["m"][0]
    hits_before = decode.get_stats()["foveal:prefix_cache_hits_total"]
    assert prefill_then_decode(prefill, decode, config, longer, "t2") == expected
    assert decode.get_stats()["foveal:prefix_cache_hits_total"] > hits_before


def test_imported_blocks_of_another_layout_fail_that_request_only(checkpoint):
    config = engine_config(checkpoint)
    decode = build_engine_core(config)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": image(4)}}
    bad = make_request(config, "bad", prompt)
    num_blocks = -(-bad.num_prompt_tokens // config.cache.block_size)
    bad.kv_import = KVImport(bad.num_prompt_tokens, {"kv": torch.zeros((1, 2, num_blocks, 1, 1, 1))})
    good = make_request(config, "good", prompt)
    decode.add_request(bad)
    decode.add_request(good)
    outputs = {}
    while decode.has_unfinished_requests():
        for output in decode.step():
            outputs.setdefault(output.request_id, []).append(output)
    assert outputs["bad"][-1].finish_reason == "error"
    assert "do not fit" in outputs["bad"][-1].error
    assert outputs["good"][-1].finish_reason == "length"
    assert decode.scheduler.kv.num_free_blocks == decode.scheduler.kv.num_blocks


def test_encode_engine_embeddings_replace_the_tower(checkpoint):
    config = engine_config(checkpoint)
    encode = build_engine_core(dataclasses.replace(
        config, transfer=dataclasses.replace(config.transfer, role="encode")))
    prefill = build_engine_core(config)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": image(5)}}
    expected = run(build_engine_core(config), [make_request(config, "m", prompt)])["m"][0]
    encode.add_request(make_request(config, "e", prompt))
    [output] = encode.step()
    assert output.finished and output.error is None and encode.num_blocks == 0
    request = make_request(config, "p", prompt)
    [feature] = request.mm_features
    request.mm_features = [feature.without_payload().with_payload(
        {ENCODED_KEY: output.embeddings[feature.mm_hash]})]
    assert run(prefill, [request])["p"][0] == expected
    assert prefill.get_stats()["foveal:encoder_items_total"] == 0


FAMILIES = ["tiny-qwen3-vl", "tiny-qwen3-vl-moe", "tiny-llava-next", "tiny-llava-onevision",
            "tiny-gemma3", "tiny-idefics3", "tiny-smolvlm"]


@pytest.mark.parametrize("preset", FAMILIES)
def test_every_family_disaggregates_like_one_engine(tiny_checkpoints, preset):
    """Encode -> prefill (the tower's rows, DeepStack and marker runs included) and
    prefill -> decode (the KV) give one mixed engine's tokens, on every model family."""
    from foveal.bench.workload import PromptVocab

    path = tiny_checkpoints(preset)
    config = engine_config(path)
    vocab = PromptVocab.from_model_dir(path)
    prompt = {"prompt_token_ids": [*vocab.image_prompt_ids, *vocab.text_token_ids[20:32]],
              "multi_modal_data": {"image": image(7)}}
    expected = run(build_engine_core(config), [make_request(config, "m", prompt)])["m"][0]

    encode = build_engine_core(dataclasses.replace(
        config, transfer=dataclasses.replace(config.transfer, role="encode")))
    encode.add_request(make_request(config, "e", prompt))
    [output] = encode.step()
    assert output.finished and output.error is None
    request = make_request(config, "p", prompt)
    [feature] = request.mm_features
    request.mm_features = [feature.without_payload().with_payload(
        {ENCODED_KEY: output.embeddings[feature.mm_hash]})]
    prefill = build_engine_core(config)
    assert run(prefill, [request])["p"][0] == expected
    assert prefill.get_stats()["foveal:encoder_items_total"] == 0

    assert prefill_then_decode(build_engine_core(config), build_engine_core(config), config,
                               prompt, "d") == expected


@pytest.mark.parametrize("preset", ["tiny-smolvlm", "tiny-llava-onevision", "tiny-qwen3-vl"])
def test_video_prompts_disaggregate_like_one_engine(tiny_checkpoints, preset):
    """A clip through encode -> prefill (its frames' rows, timestamps and markers
    included) and prefill -> decode gives one mixed engine's tokens."""
    path = tiny_checkpoints(preset)
    config = engine_config(path, max_model_len=1024, kv_cache_memory_bytes=4 << 20)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Describe."}]}]
    text = Tokenizer.from_pretrained(path).apply_chat_template(messages, add_generation_prompt=True)
    frames = [np.random.default_rng(seed).integers(0, 255, (56, 84, 3), dtype=np.uint8)
              for seed in range(4)]
    prompt = {"prompt": text, "multi_modal_data": {"video": {"frames": frames, "fps": 1.0}}}
    expected = run(build_engine_core(config), [make_request(config, "m", prompt)])["m"][0]
    encode = build_engine_core(dataclasses.replace(
        config, transfer=dataclasses.replace(config.transfer, role="encode")))
    encode.add_request(make_request(config, "e", prompt))
    [output] = encode.step()
    assert output.finished and output.error is None
    request = make_request(config, "p", prompt)
    [feature] = request.mm_features
    assert feature.modality == "video"
    request.mm_features = [feature.without_payload().with_payload(
        {ENCODED_KEY: output.embeddings[feature.mm_hash]})]
    assert run(build_engine_core(config), [request])["p"][0] == expected
    assert prefill_then_decode(build_engine_core(config), build_engine_core(config), config,
                               prompt, "d") == expected
