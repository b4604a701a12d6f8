"""The server's media paths end to end on the tiny checkpoint: video parts, image
`detail`, the visual-token planner and its report in `usage`, PDF and audio parts
through the preprocessing stages, stage backpressure (503) and stage failures (502)."""
from __future__ import annotations

import asyncio
import base64
import contextlib
from http.server import BaseHTTPRequestHandler
import io
import shutil
import subprocess
import time

import av
import httpx
import numpy as np
import pytest
from test_openai_server import (MODEL_NAME, LiveServer, data_url, engine_stats, make_engine,
                                noise_png)

from foveal.entrypoints.openai.api_server import build_app
from foveal.entrypoints.openai.serving_engine import ServerConfig
from foveal.errors import StageError
from foveal.multimodal.media.fetch import MediaFetchConfig
from foveal.multimodal.transcriber import TranscriptSegment
from foveal.stages import register_stage, stage_target
from foveal.stages.asr import AsrItem, AsrResult
from foveal.stages.assembly import expand_preprocessed_parts_sync
from foveal.stages.base import Stage
from foveal.stages.config import StagesConfig
from foveal.stages.service import StagePools
from tests.stages.stage_documents import make_text_pdf
from tests.unit.test_media_fetch import loopback_http_server

GREEDY = {"temperature": 0.0, "max_tokens": 4}
CHAT = "/v1/chat/completions"
SLOW_ASR_TARGET = "test_server_media:SlowAsrStage"


class SlowAsrStage(Stage):
    """An "asr" stage that takes 2 s per clip; clip bytes b"fail..." fail the stage."""

    name = "asr"
    item_type = AsrItem
    result_type = AsrResult

    def process(self, item: AsrItem) -> AsrResult:
        if item.content.startswith(b"fail"):
            raise StageError("the fake speech model crashed on this clip")
        time.sleep(2.0)
        return AsrResult([TranscriptSegment(0.0, 1.0, item.content.decode())], 1.0)


def make_clip_bytes(num_frames: int = 8, fps: int = 4, size: tuple[int, int] = (64, 48)) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for index in range(num_frames):
            pixels = np.full((size[1], size[0], 3), 20 * index % 256, np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        out.mux(stream.encode())
    return buffer.getvalue()


def speak(text: str, path) -> bytes:
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        pytest.fail("espeak-ng is not installed; the speech tests need it: apt-get install -y espeak-ng")
    subprocess.run([espeak, "-s", "150", "-w", str(path), text], check=True)
    return path.read_bytes()


@contextlib.contextmanager
def bytes_http_server(files: dict[str, bytes]):
    """A 127.0.0.1 server answering GET /NAME with files[NAME]."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's spelling)
            body = files.get(self.path.lstrip("/"))
            self.send_response(404 if body is None else 200)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args) -> None:
            pass

    with loopback_http_server(Handler) as base_url:
        yield base_url


@contextlib.contextmanager
def media_server(engine, model_dir: str, pools: StagePools):
    media = MediaFetchConfig(timeout_s=5.0, max_bytes=2_000_000,
                             allowed_media_domains=("127.0.0.1",))  # the test's media server
    config = ServerConfig(served_model_names=(MODEL_NAME,), model_path=model_dir, media=media)
    with LiveServer(build_app(engine, config, stage_pools=pools)) as server:
        yield server


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = make_engine(checkpoint, max_model_len=2048, kv_cache_memory_bytes=16 << 20,
                         limit_mm_per_prompt={"image": 2, "video": 1})
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def pools():
    with StagePools({"pdf": 1, "asr": 1}) as stage_pools:
        yield stage_pools


@pytest.fixture(scope="module")
def http(engine, checkpoint, pools):
    with media_server(engine, checkpoint, pools) as server, \
            httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def chat(http, content: list[dict], **fields) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": content}],
            **GREEDY, **fields}
    return http.post(CHAT, json=body)


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def image_part(url: str, detail: str | None = None) -> dict:
    options = {"url": url} if detail is None else {"url": url, "detail": detail}
    return {"type": "image_url", "image_url": options}


def test_video_chat_by_data_url_and_http_url_reports_video_tokens_and_plan(http):
    clip = make_clip_bytes()
    question = {"type": "text", "text": "What happens?"}
    by_data = chat(http, [video_part("data:video/mp4;base64," + base64.b64encode(clip).decode()),
                          question])
    with bytes_http_server({"clip.mp4": clip}) as base:
        by_http = chat(http, [video_part(f"{base}/clip.mp4"), question])
    assert by_data.status_code == 200, by_data.text
    assert by_http.status_code == 200, by_http.text
    usage = by_data.json()["usage"]
    video_tokens = usage["prompt_tokens_details"]["video_tokens"]
    assert video_tokens > 0 and usage["prompt_tokens_details"]["image_tokens"] == 0
    [plan] = usage["mm_plan"]
    assert plan["modality"] == "video" and plan["num_tokens"] == video_tokens
    assert plan["num_frames"] >= 2 and plan["max_pixels"] > 0
    http_usage = by_http.json()["usage"]
    assert (http_usage["mm_plan"], http_usage["prompt_tokens"]) == (usage["mm_plan"],
                                                                   usage["prompt_tokens"])
    assert http_usage["prompt_tokens_details"]["cached_tokens"] > 0  # same video, same KV
    assert by_http.json()["choices"][0]["message"] == by_data.json()["choices"][0]["message"]


def test_video_url_that_is_not_a_video_is_400_naming_the_video(http):
    response = chat(http, [video_part("data:image/png;base64,AAAA")])
    assert response.status_code == 400
    assert "not a video" in response.json()["error"]["message"]


def test_detail_low_gives_about_a_quarter_of_the_high_tokens(http):
    url = data_url(noise_png((448, 448), seed=5))
    tokens = {}
    for detail in ("low", "high"):
        response = chat(http, [image_part(url, detail), {"type": "text", "text": "Describe."}])
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        [plan] = usage["mm_plan"]
        assert plan["detail"] == detail and plan["modality"] == "image"
        tokens[detail] = usage["prompt_tokens_details"]["image_tokens"]
        assert plan["num_tokens"] == tokens[detail]
    assert 3.5 <= tokens["high"] / tokens["low"] <= 4.5, tokens


def test_max_visual_tokens_fits_the_request_or_is_400_below_the_minimum(http):
    url = data_url(noise_png((448, 448), seed=6))
    content = [image_part(url), {"type": "text", "text": "Describe."}]
    whole = chat(http, content).json()["usage"]["prompt_tokens_details"]["image_tokens"]
    budget = whole // 3
    fitted = chat(http, content, mm_processor_kwargs={"max_visual_tokens": budget})
    assert fitted.status_code == 200, fitted.text
    assert 0 < fitted.json()["usage"]["prompt_tokens_details"]["image_tokens"] <= budget
    too_small = chat(http, content, mm_processor_kwargs={"max_visual_tokens": 1})
    assert too_small.status_code == 400
    assert "max_visual_tokens" in too_small.json()["error"]["message"]


def test_streamed_usage_carries_the_plan(http):
    url = data_url(noise_png((100, 80), seed=7))
    body = {"model": MODEL_NAME, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": [image_part(url, "low")]}], **GREEDY}
    with http.stream("POST", CHAT, json=body) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: {")]
    usage = httpx.Response(200, content=events[-1][len("data: "):]).json()["usage"]
    assert [item["detail"] for item in usage["mm_plan"]] == ["low"]


def _same_prompt_as_expanded(http, pools, content: list[dict]) -> tuple[int, str]:
    """The server's prompt tokens for `content`, which must equal those of the
    parts the stages expand it into; returns (prompt tokens, the expanded text)."""
    served = chat(http, content)
    assert served.status_code == 200, served.text
    [message] = expand_preprocessed_parts_sync([{"role": "user", "content": content}], pools)
    expected = chat(http, message["content"])
    assert served.json()["usage"]["prompt_tokens"] == expected.json()["usage"]["prompt_tokens"]
    text = "".join(part.get("text", "") for part in message["content"])
    return served.json()["usage"]["prompt_tokens"], text


def test_pdf_file_part_reaches_the_prompt(http, pools):
    pdf = base64.b64encode(make_text_pdf([["The secret word is banana."]])).decode()
    file_part = {"type": "file", "file": {"file_data": f"data:application/pdf;base64,{pdf}",
                                          "filename": "note.pdf"}}
    question = {"type": "text", "text": "What is the word?"}
    with_pdf, text = _same_prompt_as_expanded(http, pools, [file_part, question])
    assert "banana" in text and '[PDF "note.pdf" page 1 text]' in text
    without = chat(http, [question]).json()["usage"]["prompt_tokens"]
    assert with_pdf > without + 5
    stats = engine_stats(str(http.base_url))
    assert stats['foveal:stage_items_total{stage="pdf"}'] >= 1


def test_input_audio_is_transcribed(http, pools, tmp_path):
    wav = speak("Please open the front door.", tmp_path / "door.wav")
    audio_part = {"type": "input_audio",
                  "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    _, text = _same_prompt_as_expanded(http, pools, [audio_part])
    assert text.startswith("[Transcript of audio 00:00-") and "front door" in text.lower()
    assert engine_stats(str(http.base_url))['foveal:stage_items_total{stage="asr"}'] >= 1


def test_unknown_preprocessing_option_value_is_400(http):
    response = chat(http, [{"type": "text", "text": "hi"}], mm_processor_kwargs={"ocr": "maybe"})
    assert response.status_code == 400 and "ocr='maybe'" in response.json()["error"]["message"]


def _audio_request(content: bytes) -> dict:
    part = {"type": "input_audio",
            "input_audio": {"data": base64.b64encode(content).decode(), "format": "wav"}}
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": [part]}], **GREEDY}


def test_full_stage_queue_is_503_and_a_failed_stage_is_502(engine, checkpoint):
    slow = StagePools(StagesConfig(workers={"asr": 1}, queue_size=1))
    real_target = stage_target("asr")
    register_stage("asr", SLOW_ASR_TARGET)
    try:
        slow.backend("asr")  # the pool takes the slow stage; later pools get the real one
    finally:
        register_stage("asr", real_target)

    async def three_at_once(base_url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            return await asyncio.gather(*(client.post(CHAT, json=_audio_request(f"clip {i}".encode()))
                                          for i in range(3)))

    with slow, media_server(engine, checkpoint, slow) as server:
        responses = asyncio.run(three_at_once(server.base_url))
        failed = httpx.post(f"{server.base_url}{CHAT}", json=_audio_request(b"fail"), timeout=60)
    statuses = sorted(response.status_code for response in responses)
    # one clip runs, one waits in the queue of 1: the third is turned away
    assert statuses[-1] == 503 and set(statuses) <= {200, 503}, statuses
    error = next(r for r in responses if r.status_code == 503).json()["error"]
    assert error["type"] == "server_error" and "--stage-queue-size" in error["message"]
    assert failed.status_code == 502
    assert failed.json()["error"]["message"] == "the fake speech model crashed on this clip"


def test_serve_flags_set_the_default_visual_token_budget_and_the_stages():
    from foveal.entrypoints.cli import build_parser
    from foveal.entrypoints.serve import serve_engine_kwargs, server_config
    from foveal.errors import ConfigError

    args = build_parser().parse_args([
        "serve", "/models/x", "--max-visual-tokens", "300", "--mm-processor-kwargs",
        '{"max_pixels": 401408}', "--stage-workers", "ocr=2,asr=1", "--stage-queue-size", "5"])
    assert serve_engine_kwargs(args)["mm_processor_kwargs"] == {"max_pixels": 401408,
                                                                "max_visual_tokens": 300}
    stages = server_config(args, "/models/x").stages
    assert (dict(stages.workers), stages.queue_size) == ({"ocr": 2, "asr": 1}, 5)
    zero = build_parser().parse_args(["serve", "--max-visual-tokens", "0"])
    with pytest.raises(ConfigError, match="--max-visual-tokens"):
        serve_engine_kwargs(zero)
