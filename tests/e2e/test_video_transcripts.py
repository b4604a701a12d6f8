"""A video's audio track is transcribed by default: the "asr" stage's transcript
(real whisper on espeak-ng speech) goes right after the video in the prompt
through LLM.chat, LLM.generate, the OpenAI server and `foveal generate --video`;
transcribe_audio=false keeps it out; a clip without an audio track, or with a
silent one, adds nothing and never reaches the stage."""
from __future__ import annotations

import base64

import httpx
import pytest
from speech_clips import mute_clip, silent_clip, speech_clip
from test_openai_server import MODEL_NAME, LiveServer

from foveal import LLM, SamplingParams
from foveal.entrypoints.cli import main
from foveal.entrypoints.openai.api_server import build_app
from foveal.entrypoints.openai.serving_engine import ServerConfig
from foveal.multimodal.media.audio_track import speech_wav
from foveal.stages.assembly import video_transcripts_sync
from foveal.stages.service import StagePools

MARK = "[Transcript of video 1 audio (asr: whisper)]"
ENGINE = {"max_model_len": 2048, "kv_cache_memory_bytes": 16 << 20}
QUESTION = "What is said?"
RAW_PROMPT = (f"<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>{QUESTION}<|im_end|>\n"
              "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("clips")
    return {"speech": speech_clip("Please open the front door.", root),
            "silent": silent_clip(), "mute": mute_clip()}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def pools():
    with StagePools({"asr": 1}) as stage_pools:
        yield stage_pools


@pytest.fixture(scope="module")
def llm(checkpoint, pools):
    llm = LLM(model=checkpoint, stages=pools, **ENGINE)
    yield llm
    llm.shutdown()


def video_url(clip: bytes) -> str:
    return "data:video/mp4;base64," + base64.b64encode(clip).decode()


def video_message(clip: bytes) -> dict:
    return {"role": "user", "content": [{"type": "video_url", "video_url": {"url": video_url(clip)}},
                                        {"type": "text", "text": QUESTION}]}


def prompt_text(llm: LLM, output) -> str:
    return llm.get_tokenizer().decode(output.prompt_token_ids, skip_special_tokens=False)


def chat_prompt(llm: LLM, clip: bytes, **kwargs) -> str:
    [output] = llm.chat([video_message(clip)], SamplingParams(max_tokens=1), use_tqdm=False, **kwargs)
    return prompt_text(llm, output)


def asr_requests(pools: StagePools) -> float:
    """Items sent to the asr stage, answered by a worker or by its cache."""
    metrics = pools.get_metrics()
    return sum(metrics.get(f'foveal:stage_cache_{kind}_total{{stage="asr"}}', 0)
               for kind in ("hits", "misses"))


def test_llm_chat_puts_the_speech_of_a_video_right_after_it(llm, clips):
    text = chat_prompt(llm, clips["speech"])
    assert f"<|vision_end|>\n{MARK}\n[0.0s-" in text
    transcript = text[text.index(MARK):text.index(QUESTION)]
    assert "front door" in transcript.lower()


def test_smolvlm_puts_the_speech_after_the_frames(tiny_checkpoints, pools, clips):
    """SmolVLM2's video prompt (intro, timestamped frames, outro), then the transcript."""
    llm = LLM(model=tiny_checkpoints("tiny-smolvlm"), stages=pools, **ENGINE)
    try:
        text = chat_prompt(llm, clips["speech"])
    finally:
        llm.shutdown()
    assert "frames from a 0:00:0" in text and "Frame from 00:00:" in text
    outro = text.rindex("<|vision_start|>") + len("<|vision_start|>")
    assert text[outro:].startswith(f"\n\n\n{MARK}\n[0.0s-")  # outro, then the marked transcript
    assert "front door" in text[outro:text.index(QUESTION)].lower()


def test_llm_generate_transcribes_a_video_file_from_the_stage_cache(llm, clips, pools, tmp_path):
    path = tmp_path / "door.mp4"
    path.write_bytes(clips["speech"])
    chat_prompt(llm, clips["speech"])
    hits = pools.get_metrics()['foveal:stage_cache_hits_total{stage="asr"}']
    [output] = llm.generate({"prompt": RAW_PROMPT, "multi_modal_data": {"video": str(path)}},
                            SamplingParams(max_tokens=1), use_tqdm=False)
    text = prompt_text(llm, output)
    assert MARK in text and "front door" in text.lower()
    assert pools.get_metrics()['foveal:stage_cache_hits_total{stage="asr"}'] == hits + 1


def test_transcribe_audio_false_keeps_the_transcript_out(llm, clips, pools):
    before = asr_requests(pools)
    assert "Transcript" not in chat_prompt(llm, clips["speech"],
                                           mm_processor_kwargs={"transcribe_audio": False})
    prompt = {"prompt": RAW_PROMPT, "multi_modal_data": {"video": clips["speech"]},
              "mm_processor_kwargs": {"transcribe_audio": False}}
    [output] = llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    assert "Transcript" not in prompt_text(llm, output)
    assert asr_requests(pools) == before


def test_clip_without_audio_or_with_silence_adds_nothing_and_starts_no_speech_model(checkpoint, clips):
    llm = LLM(model=checkpoint, **ENGINE)
    try:
        for clip in (clips["mute"], clips["silent"]):
            text = chat_prompt(llm, clip)
            assert "Transcript" not in text and text.index("<|vision_end|>") < text.index(QUESTION)
        assert not any('stage="asr"' in name for name in llm.get_metrics())
    finally:
        llm.shutdown()


def test_server_puts_the_transcript_of_a_video_url_in_the_prompt(checkpoint, pools, clips):
    from foveal.async_engine import AsyncLLM
    from foveal.engine_args import EngineArgs

    engine = AsyncLLM(EngineArgs.from_kwargs(checkpoint, **ENGINE), preprocess_workers=1, stages=pools)
    config = ServerConfig(served_model_names=(MODEL_NAME,), model_path=checkpoint)

    def prompt_tokens(client: httpx.Client, **kwargs) -> int:
        body = {"model": MODEL_NAME, "messages": [video_message(clips["speech"])], "max_tokens": 1, **kwargs}
        response = client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens"]

    try:
        with LiveServer(build_app(engine, config, stage_pools=pools)) as server, \
                httpx.Client(base_url=server.base_url, timeout=120) as client:
            before = asr_requests(pools)
            with_speech = prompt_tokens(client)
            assert asr_requests(pools) == before + 1
            without = prompt_tokens(client, mm_processor_kwargs={"transcribe_audio": False})
            assert asr_requests(pools) == before + 1
    finally:
        engine.shutdown()
    [transcript] = video_transcripts_sync(pools, [speech_wav(clips["speech"])])  # the stage's cached answer
    assert transcript.startswith(f"\n{MARK}\n") and "front door" in transcript.lower()
    assert with_speech - without == len(engine.tokenizer.encode(transcript))


def test_foveal_generate_video_puts_its_speech_in_the_prompt(checkpoint, clips, chat_prompts, tmp_path):
    path = tmp_path / "door.mp4"
    path.write_bytes(clips["speech"])
    flags = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(16 << 20), "--max-tokens", "1"]
    assert main(["generate", "--model", checkpoint, *flags, "--video", str(path), QUESTION]) == 0
    assert main(["generate", "--model", checkpoint, *flags, "--video", str(path), "--mm-processor-kwargs",
                 '{"transcribe_audio": false}', QUESTION]) == 0
    spoken, muted = chat_prompts
    assert MARK in spoken and "front door" in spoken.lower()
    assert "Transcript" not in muted
