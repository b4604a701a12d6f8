"""Idefics3 engine features on a tiny checkpoint: tensor parallelism (the tower
sharded, or whole on every rank with a step's images split over the ranks),
n-gram speculation and int8 KV with chunks through image ranges give the tokens
of one rank; a video is a clear error, never a silent answer."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from foveal import LLM, SamplingParams
from foveal.errors import InvalidRequestError

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
OPTIONS = dict(max_model_len=512, kv_cache_memory_bytes=1 << 21, max_num_batched_tokens=256,
               kv_cache_dtype="int8")


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _user(text: str, *images: Image.Image) -> list[dict]:
    parts = [{"type": "image_pil", "image_pil": image} for image in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def _chats() -> list:
    return [_user("Describe it.", _image(130, 40, 1)), _user("Say red green blue, red green blue."),
            _user("Compare.", _image(40, 150, 2), _image(60, 60, 3))]


def _run(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.chat(_chats(), GREEDY, use_tqdm=False)]


def test_tensor_parallel_speculation_and_int8_kv_give_the_tokens_of_one_rank(tiny_checkpoints):
    path = tiny_checkpoints("tiny-idefics3")
    one_rank = LLM(model=path, **OPTIONS)
    expected = _run(one_rank)
    video = {"prompt": "<|video_pad|>What happens?",
             "multi_modal_data": {"video": [np.zeros((16, 16, 3), np.uint8)] * 4}}
    with pytest.raises(InvalidRequestError, match="images only"):
        one_rank.generate([video], GREEDY, use_tqdm=False)
    missing = {**video, "multi_modal_data": {"video": "/nonexistent/clip.mp4"}}
    with pytest.raises(InvalidRequestError, match="images only"):  # refused before it is opened
        one_rank.generate([missing], GREEDY, use_tqdm=False)
    for options in ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3},
                     "max_num_batched_tokens": 16},  # sharded tower, chunks through the images
                    {"mm_encoder_tp_mode": "data"}):  # each rank encodes some of a step's images
        llm = LLM(model=path, tensor_parallel_size=2, **{**OPTIONS, **options})
        try:
            assert _run(llm) == expected
        finally:
            llm.shutdown()
