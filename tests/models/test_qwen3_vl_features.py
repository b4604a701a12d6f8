"""Qwen3-VL with the engine's other features: two tensor-parallel ranks (with a
data-parallel vision tower), int8 KV blocks, n-gram speculation and chunked
prefill through images and a video give the tokens of one plain rank with the
same KV dtype; a disaggregated encode worker's embeddings carry DeepStack."""
from __future__ import annotations

import numpy as np
from PIL import Image

from foveal import LLM, SamplingParams
from foveal.config import EngineConfig
from foveal.disagg import exchange
from foveal.engine.request import Request
from foveal.multimodal.inputs import ENCODED_KEY, MMFeature, PlaceholderRange

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
OPTIONS = dict(max_model_len=512, kv_cache_memory_bytes=1 << 21, kv_cache_dtype="int8")


def _frames(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (64, 96, 3), dtype=np.uint8) for _ in range(count)]


def _run(llm: LLM) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()

    def prompt(parts: list[dict], text: str, media: dict) -> dict:
        messages = [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]
        return {"prompt": tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                "multi_modal_data": media}

    prompts = [prompt([{"type": "image"}, {"type": "video"}], "what moves?",
                      {"image": Image.fromarray(_frames(1, 1)[0]),
                       "video": {"frames": _frames(4, 2), "fps": 1}}),
               prompt([{"type": "image"}] * 2, "red green blue, red green blue",
                      {"image": [Image.fromarray(f) for f in _frames(2, 3)]}),
               {"prompt": "say red green blue, red green blue"}]
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_two_ranks_int8_kv_ngram_and_chunks_give_the_tokens_of_one(tiny_checkpoints):
    path = tiny_checkpoints("tiny-qwen3-vl")
    expected = _run(LLM(model=path, **OPTIONS))
    llm = LLM(model=path, tensor_parallel_size=2, mm_encoder_tp_mode="data",
              max_num_batched_tokens=32, **OPTIONS,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    try:
        assert _run(llm) == expected
        assert llm.get_metrics()["foveal:spec_decode_num_drafts_total"] > 0
    finally:
        llm.shutdown()


def test_encode_worker_embeddings_are_pulled_with_their_deepstack_columns(tiny_checkpoints, monkeypatch):
    from foveal.config import CacheConfig, MultimodalConfig, SchedulerConfig
    from foveal.loader.hf_config import model_config_from_hf

    model = model_config_from_hf(tiny_checkpoints("tiny-qwen3-vl"))
    config = EngineConfig(model, CacheConfig(), SchedulerConfig(), MultimodalConfig())
    feature = MMFeature("image", "h", PlaceholderRange(3, 4), {"grid_thw": (1, 4, 4)})
    request = Request("r", [0] * 10, [feature], GREEDY, arrival_time=0.0)
    wide = np.zeros((4, 3 * 64), dtype=np.float32)
    monkeypatch.setattr(exchange, "_fetch", lambda *args: {"h": ({}, {ENCODED_KEY: wide})})
    exchange._pull_embeddings(request, {"items": {"h": 4}}, config, stats=None)
    assert request.mm_features[0].data[ENCODED_KEY] is wide
