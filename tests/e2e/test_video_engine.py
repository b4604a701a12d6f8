"""Video through the whole engine: greedy parity with transformers for a
video request and a video + image request (same patches fed to both), the
budget plan reported per item, and the transcript hook."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from foveal import LLM, SamplingParams
from foveal.errors import MediaLimitError
from foveal.multimodal.chat import parse_chat_conversation
from foveal.multimodal.transcriber import TranscriptSegment

MAX_TOKENS = 8


def _frames(num_frames: int, width: int, height: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (height, width, 3), dtype=np.uint8) for _ in range(num_frames)]


def _prompt(llm: LLM, parts: list[dict], text: str, media: dict) -> dict:
    """parts: chat-template parts ({"type": "image"} / {"type": "video"})."""
    messages = [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]
    prompt = llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True)
    return {"prompt": prompt, "multi_modal_data": media}


def _hf_inputs(features, token_ids: list[int], model_config) -> dict:
    """transformers kwargs from Foveal's own processed items (same patches)."""
    ids = torch.tensor([token_ids])
    inputs = {"mm_token_type_ids": (ids == model_config.image_token_id).long()
              + 2 * (ids == model_config.video_token_id).long()}
    images = [f for f in features if f.modality == "image"]
    videos = [f for f in features if f.modality == "video"]
    if images:
        inputs["pixel_values"] = torch.cat([f.data["pixel_values"] for f in images])
        inputs["image_grid_thw"] = torch.tensor([f.data["grid_thw"] for f in images])
    if videos:
        inputs["pixel_values_videos"] = torch.cat([f.data["pixel_values_videos"] for f in videos])
        inputs["video_grid_thw"] = torch.tensor([f.data["grid_thw"] for f in videos])
        if model_config.vision.tokens_per_second:
            inputs["second_per_grid_ts"] = torch.tensor([f.data["second_per_grid_t"] for f in videos])
    return inputs


@torch.inference_mode()
def _hf_greedy(model, prompt_ids: list[int], features, model_config) -> list[int]:
    ids = list(prompt_ids)
    for _ in range(MAX_TOKENS):
        inputs = _hf_inputs(features, ids, model_config)
        logits = model(input_ids=torch.tensor([ids]), use_cache=False, **inputs).logits[0, -1]
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("preset", ["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def test_video_and_video_with_image_match_transformers(tiny_checkpoints, preset):
    import transformers

    path = tiny_checkpoints(preset)
    llm = LLM(model=path, max_model_len=1024, max_num_batched_tokens=64, block_size=16)
    video = {"frames": _frames(6, 84, 56, seed=1), "fps": 1}  # 2 s per temporal patch
    prompts = [
        _prompt(llm, [{"type": "video"}], "What happens in this clip?", {"video": video}),
        _prompt(llm, [{"type": "image"}, {"type": "video"}], "Is the picture in the video?",
                {"image": Image.fromarray(_frames(1, 112, 84, seed=2)[0]),
                 "video": _frames(4, 56, 84, seed=3)}),
    ]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)

    config = llm.llm_engine.config.model
    hf_cls = getattr(transformers, config.architecture)
    hf_model = hf_cls.from_pretrained(path, dtype=torch.float32).eval()
    processor = llm.llm_engine.input_processor
    for prompt, output in zip(prompts, outputs):
        request = processor.process("ref", prompt, params).request
        assert request.prompt_token_ids == output.prompt_token_ids
        assert any(f.modality == "video" for f in request.mm_features)
        expected = _hf_greedy(hf_model, request.prompt_token_ids, request.mm_features, config)
        assert list(output.outputs[0].token_ids) == expected


@pytest.fixture(scope="module")
def tiny_llm(tiny_checkpoints):
    return LLM(model=tiny_checkpoints("tiny-qwen2.5-vl"), max_model_len=4096)


def test_budget_plan_is_reported_per_item_in_prompt_order(tiny_llm):
    processor = tiny_llm.llm_engine.input_processor
    video = {"frames": _frames(40, 224, 224, seed=4), "fps": 4}
    image = Image.fromarray(_frames(1, 448, 448, seed=5)[0])
    prompt = _prompt(tiny_llm, [{"type": "image"}, {"type": "video"}], "Describe.",
                     {"image": image, "video": video})
    full = processor.process("a", prompt, SamplingParams())
    budget = sum(p.num_tokens for p in full.mm_plan) // 3
    cut = processor.process("b", {**prompt, "mm_processor_kwargs": {"max_visual_tokens": budget}},
                                   SamplingParams())
    assert [p.modality for p in cut.mm_plan] == ["image", "video"]
    assert [p.num_tokens for p in cut.mm_plan] == [f.placeholder.length for f in cut.request.mm_features]
    assert sum(p.num_tokens for p in cut.mm_plan) <= budget < sum(p.num_tokens for p in full.mm_plan)
    with pytest.raises(MediaLimitError, match="budget is 10 "):
        processor.process("c", {**prompt, "mm_processor_kwargs": {"max_visual_tokens": 10}},
                                 SamplingParams())


def test_low_detail_image_part_gets_about_a_quarter_of_the_tokens(tiny_llm):
    processor = tiny_llm.llm_engine.input_processor
    image = Image.fromarray(_frames(1, 448, 336, seed=6)[0])
    plans = {}
    for detail in ("high", "low"):
        part = {"type": "image_url", "image_url": {"url": image, "detail": detail}}
        conversation = parse_chat_conversation([{"role": "user", "content": [part]}])
        prompt = _prompt(tiny_llm, [{"type": "image"}], "", conversation.multi_modal_data())
        plans[detail] = processor.process(detail, prompt, SamplingParams()).mm_plan[0].num_tokens
    assert plans["low"] * 4 == plans["high"]  # 16x12 -> 8x6 merged tokens


class _FixedTranscriber:
    name = "fixed"

    def transcribe(self, samples, sample_rate):
        return [TranscriptSegment(0.0, 1.0, "hello there")]


def test_configured_transcriber_puts_the_transcript_after_the_video(tiny_llm, tmp_path):
    av = pytest.importorskip("av")
    from foveal.input_processor import InputProcessor

    path = str(tmp_path / "talk.mp4")
    with av.open(path, "w") as out:
        video, audio = out.add_stream("mpeg4", rate=10), out.add_stream("aac", rate=16000)
        video.width, video.height, video.pix_fmt = 56, 56, "yuv420p"
        for frame in _frames(10, 56, 56, seed=7):
            out.mux(video.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(video.encode())
        tone = av.AudioFrame.from_ndarray(np.zeros((1, 16000), np.float32), format="fltp", layout="mono")
        tone.sample_rate = 16000
        out.mux(audio.encode(tone))
        out.mux(audio.encode())
    engine = tiny_llm.llm_engine
    processor = InputProcessor(engine.config, engine.tokenizer, transcriber=_FixedTranscriber())
    prompt = _prompt(tiny_llm, [{"type": "video"}], "Summarize.", {"video": path})
    request = processor.process("t", prompt, SamplingParams()).request
    text = engine.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
    assert "<|vision_end|>\n[Transcript of video 1 audio (asr: fixed)]\n[0.0s-1.0s] hello there\n" in text
    assert text.index("Transcript") < text.index("Summarize.")
