"""SmolVLM (SmolVLM2) video through Foveal's LLM equals transformers on the tiny
checkpoint: the video's prompt text is what transformers' SmolVLMProcessor
writes (frame count in words, duration, per-frame timestamps and markers);
greedy tokens and logprobs match transformers fed the same frames, with prefill
chunks cutting through the frames; a repeated clip hits the prefix and encoder
caches; the visual-token budget drops frames; Idefics3 refuses videos."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor
from transformers.video_utils import VideoMetadata

from foveal import LLM, SamplingParams
from foveal.errors import InvalidRequestError
from foveal.multimodal.processors.idefics3 import MarkerTokens
from foveal.multimodal.processors.idefics3_family import TINY_MARKERS
from foveal.multimodal.processors.smolvlm_video import video_prompt

MAX_TOKENS = 5
IMAGE_TOKEN = 12
SEQ_LEN = 16
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
MARKERS = MarkerTokens(TINY_MARKERS["image_token"], TINY_MARKERS["fake_image_token"],
                       TINY_MARKERS["global_image_token"])


def _clip(num_frames: int, seed: int, size: tuple[int, int] = (80, 48)) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8) for _ in range(num_frames)]


def _user(text: str, frames=None, fps: float = 1.0) -> list[dict]:
    parts = [{"type": "video", "video": {"frames": frames, "fps": fps}}] if frames is not None else []
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def setup(tiny_checkpoints):
    import transformers

    path = tiny_checkpoints("tiny-smolvlm")
    hf = transformers.SmolVLMForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    # 11-token steps: prefill chunks end inside the frames' runs (16 tokens each)
    llm = LLM(model=path, max_model_len=2048, max_num_batched_tokens=11, max_num_seqs=4, block_size=8,
              kv_cache_memory_bytes=8 << 20)
    return path, llm, hf


@pytest.mark.parametrize("num_frames, fps, duration", [(3, 1.0, 3.0), (21, 0.25, 84.0), (1, 2.0, 0.5)])
def test_video_prompt_is_transformers_text(num_frames, fps, duration):
    indices = list(range(num_frames))
    metadata = VideoMetadata(total_num_frames=num_frames, fps=fps, duration=duration,
                             frames_indices=indices)
    stub = SimpleNamespace(image_seq_len=SEQ_LEN, image_token=MARKERS.image,
                           fake_image_token=MARKERS.fake, global_image_token=MARKERS.global_image)
    inputs = {"pixel_values": torch.zeros(1, num_frames), "video_metadata": [metadata]}
    expected = SmolVLMProcessor.replace_video_token(stub, inputs, 0)
    assert video_prompt(MARKERS, SEQ_LEN, [i / fps for i in indices], duration) == expected


@torch.inference_mode()
def _hf_greedy(model, prompt_ids: list[int], pixel_values: torch.Tensor) -> tuple[list[int], list[float]]:
    """A full transformers forward per step, the frames as one image batch."""
    mm = {"pixel_values": pixel_values[None],
          "pixel_attention_mask": torch.ones(1, *pixel_values.shape[:1], *pixel_values.shape[2:],
                                             dtype=torch.long)}
    ids, tokens, logprobs = list(prompt_ids), [], []
    for _ in range(MAX_TOKENS):
        logits = model(input_ids=torch.tensor([ids]), **mm).logits[0, -1].float()
        token = int(torch.argmax(logits))
        tokens.append(token)
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return tokens, logprobs


def _frames_as_processed(llm, frames: list[np.ndarray], fps: float) -> torch.Tensor:
    """The frames through Foveal's video processor (transformers' resizes through torchvision)."""
    from foveal.multimodal.media.video import load_video, probe_video

    processor = llm.llm_engine.input_processor.video_processor
    source = {"frames": frames, "fps": fps}
    info = probe_video(source, processor.sampling, 1 << 30)
    video = load_video(source, info, processor.sampling.num_frames(info.num_frames, info.fps),
                       processor.sampling)
    return processor.process(video).pixel_values


def _check(llm, hf, frames, fps, output) -> None:
    pixels = _frames_as_processed(llm, frames, fps)
    tokens, logprobs = _hf_greedy(hf, output.prompt_token_ids, pixels)
    completion = output.outputs[0]
    assert list(completion.token_ids) == tokens
    ours = [step[token].logprob for step, token in zip(completion.logprobs, tokens)]
    np.testing.assert_allclose(ours, logprobs, atol=2e-4, rtol=0)


def test_greedy_tokens_and_logprobs_match_transformers(setup):
    _, llm, hf = setup
    clips = [(_clip(3, 1), 1.0), (_clip(8, 2, (40, 90)), 2.0)]  # 3 frames; 8 at 2 fps -> 4 at 1 fps
    conversations = [_user("What happens here?", *clips[0]), _user("Tell me a story."),
                     _user("Describe the clip.", *clips[1])]
    outputs = llm.chat(conversations, PARAMS, use_tqdm=False)
    assert [o.prompt_token_ids.count(IMAGE_TOKEN) for o in outputs] == [3 * SEQ_LEN, 0, 4 * SEQ_LEN]
    text = llm.get_tokenizer().decode(outputs[2].prompt_token_ids, skip_special_tokens=False)
    assert "series of four frames from a 0:00:04 [H:MM:SS] video." in text
    assert [text.count(f"Frame from 00:0{s}:") for s in range(5)] == [1, 1, 1, 1, 0]
    for (frames, fps), index in zip(clips, (0, 2)):
        _check(llm, hf, frames, fps, outputs[index])


def test_repeated_clip_hits_prefix_and_encoder_caches(setup):
    _, llm, hf = setup
    frames = _clip(5, 7)
    first = llm.chat([_user("What is this?", frames)], PARAMS, use_tqdm=False)[0]
    again = llm.chat([_user("What is this?", frames)], PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens >= len(first.prompt_token_ids) // 8 * 8 - 8
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    moved = [{"role": "assistant", "content": "Ready."}, *_user("Now this?", frames)]
    output = llm.chat([moved], PARAMS, use_tqdm=False)[0]
    assert (output.encoder_cache_queries, output.encoder_cache_hits) == (1, 1)
    _check(llm, hf, frames, 1.0, output)


def test_budget_planner_drops_frames(setup):
    _, llm, _ = setup
    clip = _user("What happens?", _clip(6, 3))
    full = llm.chat([clip], PARAMS, use_tqdm=False)[0]
    small = llm.chat([clip], PARAMS, use_tqdm=False, mm_processor_kwargs={"max_visual_tokens": 40})[0]
    fewer = llm.chat([clip], PARAMS, use_tqdm=False, mm_processor_kwargs={"max_frames": 2})[0]
    assert full.prompt_token_ids.count(IMAGE_TOKEN) == 6 * SEQ_LEN
    assert small.prompt_token_ids.count(IMAGE_TOKEN) == 2 * SEQ_LEN
    assert fewer.prompt_token_ids.count(IMAGE_TOKEN) == 2 * SEQ_LEN
    assert small.mm_plan[0].downsampled and small.mm_plan[0].num_frames == 2


def test_idefics3_refuses_videos_and_video_options(tiny_checkpoints):
    llm = LLM(model=tiny_checkpoints("tiny-idefics3"), max_model_len=1024, kv_cache_memory_bytes=8 << 20)
    with pytest.raises(InvalidRequestError, match="images only"):
        llm.chat([_user("What happens?", _clip(3, 1))], PARAMS, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match=r"unknown mm_processor_kwargs \['fps'\]"):
        llm.chat([_user("Hi")], PARAMS, use_tqdm=False, mm_processor_kwargs={"fps": 2})


def test_checkpoint_without_a_video_token_refuses_videos(tiny_checkpoints, tmp_path):
    """A tokenizer where "<video>" is no single token cannot hold SmolVLM's placeholder:
    videos are refused with what to change, images still work."""
    import json
    import shutil

    path = tmp_path / "smolvlm"
    shutil.copytree(tiny_checkpoints("tiny-smolvlm"), path)
    config = json.loads((path / "preprocessor_config.json").read_text())
    del config["video_token"]  # the default, "<video>", is not in the tiny tokenizer
    (path / "preprocessor_config.json").write_text(json.dumps(config))
    llm = LLM(model=str(path), max_model_len=1024, kv_cache_memory_bytes=8 << 20)
    with pytest.raises(InvalidRequestError, match="added_tokens_decoder"):
        llm.chat([_user("What happens?", _clip(3, 1))], PARAMS, use_tqdm=False)
    assert len(llm.chat([_user("Hi")], PARAMS, use_tqdm=False)[0].outputs[0].token_ids) == MAX_TOKENS


def test_server_usage_counts_a_videos_frames_as_video_tokens():
    """SmolVLM fills a video with image tokens: usage reads the plan's modalities."""
    from foveal.entrypoints.openai.serving_engine import FinalOutput, OpenAIServing
    from foveal.multimodal.budget import ItemPlan

    serving = SimpleNamespace(image_token_id=IMAGE_TOKEN, video_token_id=13)
    final = FinalOutput([1] + [IMAGE_TOKEN] * (3 + 2) * SEQ_LEN + [2], token_ids=[5])
    final.mm_plan = [ItemPlan("video", 4096, 3, 3 * SEQ_LEN), ItemPlan("image", 4096, 1, 2 * SEQ_LEN)]
    details = OpenAIServing.usage(serving, final).prompt_tokens_details
    assert (details.image_tokens, details.video_tokens) == (2 * SEQ_LEN, 3 * SEQ_LEN)
