"""The OpenAI-compatible server end to end: a live uvicorn server on 127.0.0.1
over the tiny checkpoint, driven by the official `openai` client."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import socket
import threading
import time

import numpy as np
import pytest
from PIL import Image

import openai  # noqa: E402
import httpx  # noqa: E402
import uvicorn  # noqa: E402

from foveal.engine.output import CompletionOutput, RequestOutput  # noqa: E402
from foveal.entrypoints.openai.api_server import build_app  # noqa: E402
from foveal.entrypoints.openai.security import SecurityConfig  # noqa: E402
from foveal.entrypoints.openai.serving_engine import ServerConfig  # noqa: E402
from foveal.errors import EngineOverloadedError  # noqa: E402
from foveal.multimodal.media.fetch import MediaFetchConfig  # noqa: E402
from tests.unit.test_media_fetch import media_http_server  # noqa: E402

MODEL_NAME = "tiny"


ENGINE_OPTIONS = {"max_model_len": 1024, "max_num_seqs": 32, "kv_cache_memory_bytes": 8 << 20,
                  "limit_mm_per_prompt": {"image": 2}, "max_image_pixels": 1 << 20}


def make_engine(model_dir: str, **overrides):
    from foveal.async_engine import AsyncLLM
    from foveal.engine_args import EngineArgs

    args = EngineArgs.from_kwargs(model_dir, **{**ENGINE_OPTIONS, **overrides})
    return AsyncLLM(args, preprocess_workers=1)


class LiveServer:
    """uvicorn on a free 127.0.0.1 port in a background thread."""

    def __init__(self, app) -> None:
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]}, daemon=True)

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        for _ in range(500):
            if self._server.started:
                return self
            time.sleep(0.01)
        raise RuntimeError("server did not start in 5 s")

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()


@contextlib.contextmanager
def serving(engine, model_dir: str, media_root: str | None = None, api_key: str | None = None,
            security: SecurityConfig | None = None, media: MediaFetchConfig | None = None):
    """A live server over `engine` (several apps may share one engine). Media may come
    from 127.0.0.1, where the tests' media servers listen, unless `media` says otherwise."""
    media = media or MediaFetchConfig(timeout_s=1.5, max_bytes=200_000,
                                      allowed_local_media_path=media_root,
                                      allowed_media_domains=("127.0.0.1",))
    security = security or SecurityConfig(api_keys=(api_key,) if api_key else ())
    config = ServerConfig(served_model_names=(MODEL_NAME,), model_path=model_dir,
                          security=security, media=media)
    with LiveServer(build_app(engine, config)) as server:
        yield server


def png_bytes(size: tuple[int, int] = (56, 56), color=(200, 30, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_message(url: str, text: str = "What is in this image?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def noise_png(size: tuple[int, int], seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(
        buffer, format="PNG")
    return buffer.getvalue()


def engine_stats(base_url: str) -> dict[str, float]:
    """The engine counters and gauges of /metrics, as {'name{labels}': value}."""
    stats = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("foveal:") and " " in line:
            key, value = line.rsplit(" ", 1)
            stats[key] = float(value)
    return stats


GREEDY = {"temperature": 0.0, "max_tokens": 12}


@pytest.fixture(scope="session")
def checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints("tiny-qwen2-vl")


@pytest.fixture(scope="session")
def media_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "red.png").write_bytes(png_bytes())
    return root


@pytest.fixture(scope="session")
def shared_engine(checkpoint):
    """One AsyncLLM (core process + preprocessing pool) for every server test."""
    engine = make_engine(checkpoint)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def server(shared_engine, checkpoint, media_root):
    with serving(shared_engine, checkpoint, media_root=str(media_root)) as live:
        yield live


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def test_chat_with_data_url_image(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=image_message(data_url(png_bytes())), **GREEDY)
    choice = response.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens_details.image_tokens > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_usage_counts_the_encoder_cache_hits_of_the_request(client):
    url = data_url(png_bytes((96, 80), (10, 200, 90)))  # an image no other test sends
    first = client.chat.completions.create(model=MODEL_NAME, messages=image_message(url), **GREEDY)
    moved = [{"role": "system", "content": "Answer in one word, please."}] + image_message(url)
    second = client.chat.completions.create(model=MODEL_NAME, messages=moved, **GREEDY)
    looked_up = [(r.usage.prompt_tokens_details.encoder_cache_queries,
                  r.usage.prompt_tokens_details.encoder_cache_hits) for r in (first, second)]
    assert looked_up == [(1, 0), (1, 1)]  # encoded once, then served from the encoder cache


def test_chat_with_file_url_inside_the_allowed_folder(client, media_root):
    by_file = client.chat.completions.create(
        model=MODEL_NAME, messages=image_message(f"file://{media_root / 'red.png'}"), **GREEDY)
    by_data = client.chat.completions.create(
        model=MODEL_NAME, messages=image_message(data_url(png_bytes())), **GREEDY)
    assert by_file.choices[0].message.content == by_data.choices[0].message.content


def test_chat_with_file_url_outside_the_allowed_folder_is_400(client, media_root, tmp_path):
    (tmp_path / "secret.png").write_bytes(png_bytes())
    for url in (f"file://{tmp_path / 'secret.png'}", f"file://{media_root}/../secret.png"):
        with pytest.raises(openai.BadRequestError, match="outside the allowed media folder"):
            client.chat.completions.create(model=MODEL_NAME, messages=image_message(url),
                                           **GREEDY)


def test_chat_with_http_image_urls(client):
    with media_http_server() as base:
        response = client.chat.completions.create(
            model=MODEL_NAME, messages=image_message(f"{base}/ok.png"), **GREEDY)
        assert response.usage.prompt_tokens_details.image_tokens > 0
        with pytest.raises(openai.BadRequestError, match="--max-media-bytes"):
            client.chat.completions.create(model=MODEL_NAME,
                                           messages=image_message(f"{base}/big.png"), **GREEDY)
        with pytest.raises(openai.BadRequestError, match="--media-fetch-timeout"):
            client.chat.completions.create(model=MODEL_NAME,
                                           messages=image_message(f"{base}/slow.png"), **GREEDY)


def test_streaming_chat_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=image_message(data_url(png_bytes())), stream=True,
        stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    usage_chunks = [chunk for chunk in chunks if chunk.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion(client):
    response = client.completions.create(model=MODEL_NAME, prompt="Hello there", **GREEDY)
    assert response.object == "text_completion"
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 12 and response.usage.prompt_tokens > 0
    streamed = client.completions.create(model=MODEL_NAME, prompt="Hello there", stream=True,
                                         **GREEDY)
    assert "".join(chunk.choices[0].text for chunk in streamed) == response.choices[0].text


def test_chat_logprobs(client):
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], logprobs=True,
        top_logprobs=3, **GREEDY)
    content = response.choices[0].logprobs.content
    assert len(content) == 12
    for position in content:
        top = [entry.logprob for entry in position.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True)
        assert position.logprob == pytest.approx(top[0])  # greedy picks the top token
        assert position.token == position.top_logprobs[0].token


def test_completion_logprobs(client):
    response = client.completions.create(model=MODEL_NAME, prompt="Hello", logprobs=2,
                                         **GREEDY)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 12
    assert all(len(top) <= 2 for top in logprobs.top_logprobs)
    assert all(value <= 0 for value in logprobs.token_logprobs)


def test_stop_string_truncates_the_answer(client):
    text = client.completions.create(model=MODEL_NAME, prompt="Tell me",
                                     **GREEDY).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    expected = text[:text.find(stop)]
    response = client.completions.create(model=MODEL_NAME, prompt="Tell me", stop=[stop],
                                         **GREEDY)
    assert response.choices[0].text == expected
    assert response.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL_NAME, prompt="Tell me", stop=[stop],
                                         stream=True, **GREEDY)
    assert "".join(chunk.choices[0].text for chunk in streamed) == expected


def test_models_list(client, server):
    models = client.models.list().data
    assert [model.id for model in models] == [MODEL_NAME]
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_streamed_text_equals_whole_text_equals_offline_llm(client, checkpoint):
    from foveal import LLM, SamplingParams

    messages = image_message(data_url(noise_png((64, 48), seed=3)), "Describe it.")
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY)
    streamed = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                              stream=True, **GREEDY)
    streamed_text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed)
    llm = LLM(model=checkpoint, **ENGINE_OPTIONS)
    offline = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=12),
                       use_tqdm=False)[0]
    llm.llm_engine.shutdown()
    assert streamed_text == whole.choices[0].message.content == offline.outputs[0].text


def _error_cases() -> list[tuple[str, str, dict | str, str]]:
    """(name, path, body, fragment of the message)."""
    big_noise = data_url(noise_png((300, 300), seed=1))  # ~270 kB > 200 kB cap
    huge_pixels = data_url(png_bytes(size=(1100, 1000)))  # 1.1 MP > 1 MP limit
    garbage = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    ok = data_url(png_bytes())
    chat = "/v1/chat/completions"

    def body(messages=None, **fields):
        return {"model": MODEL_NAME, "messages": messages or image_message(ok), **fields}

    three = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ok}}] * 3}]
    video_part = {"type": "video_url", "video_url": {"url": "http://127.0.0.1:9/v.mp4"}}
    two_videos = [{"role": "user", "content": [video_part, video_part]}]
    return [
        ("malformed json", chat, '{"model": ', "not valid JSON"),
        ("missing messages", chat, {"model": MODEL_NAME}, "messages"),
        ("bad base64", chat, body(image_message("data:image/png;base64,@@@")), "base64"),
        ("undecodable image", chat, body(image_message(garbage)), "could not identify"),
        ("pixel limit", chat, body(image_message(huge_pixels)), "--max-image-pixels"),
        ("byte limit", chat, body(image_message(big_noise)), "--max-media-bytes"),
        ("too many images", chat, body(three), "limit is 2"),
        ("too many videos", chat, body(two_videos), "2 videos; the limit is 1"),
        ("context overflow", "/v1/completions",
         {"model": MODEL_NAME, "prompt": "hello " * 1100}, "max_model_len"),
        ("unknown model", chat, body(model="gpt-9"), "not served here"),
        ("bad temperature", chat, body(temperature=-1), "temperature"),
        ("n > 1", chat, body(n=2), "n=2"),
        ("bad top_p", "/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
        ("wrong type", chat, body(max_tokens="many"), "max_tokens"),
        ("prompt id out of vocabulary", "/v1/completions", {"prompt": [10**8, 5]},
         "outside the model's vocabulary"),
        ("stop id out of vocabulary", chat, body(stop_token_ids=[-5]), "outside the model's"),
    ]


def test_each_bad_request_is_a_400_in_openai_shape_and_the_next_one_works(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        for name, path, body, fragment in _error_cases():
            content = body if isinstance(body, str) else json.dumps(body)
            response = http.post(path, content=content,
                                 headers={"content-type": "application/json"})
            assert response.status_code == 400, (name, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, name
            assert error["type"] == "invalid_request_error" and error["code"] == 400, name
            assert fragment in error["message"], (name, error["message"])
        good = http.post("/v1/chat/completions", json={
            "model": MODEL_NAME, "messages": image_message(data_url(png_bytes())), **GREEDY})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 12


def test_missing_or_wrong_api_key_is_401(shared_engine, checkpoint):
    with serving(shared_engine, checkpoint, api_key="s3cret") as locked:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = httpx.get(f"{locked.base_url}/v1/models", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{locked.base_url}/health").status_code == 200
        good = openai.OpenAI(base_url=f"{locked.base_url}/v1", api_key="s3cret", max_retries=0)
        assert [model.id for model in good.models.list().data] == [MODEL_NAME]


def test_client_disconnect_mid_stream_frees_the_request_blocks(server):
    body = {"model": MODEL_NAME, "messages": image_message(data_url(png_bytes())),
            "max_tokens": 900, "ignore_eos": True, "temperature": 0.0, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
            assert engine_stats(server.base_url)["foveal:kv_cache_usage_perc"] > 0
    stats = {}
    for _ in range(100):
        stats = engine_stats(server.base_url)
        if stats["foveal:kv_cache_usage_perc"] == 0 and stats["foveal:num_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert stats["foveal:kv_cache_usage_perc"] == 0
    assert stats["foveal:num_requests_running"] == 0


def test_32_concurrent_streaming_requests_with_images_all_complete(client, server):
    images = [data_url(noise_png((56 + 8 * i, 56), seed=10 + i)) for i in range(4)]
    expected = [client.chat.completions.create(model=MODEL_NAME, messages=image_message(url),
                                               **GREEDY).choices[0].message.content
                for url in images]
    aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused",
                                 max_retries=0, timeout=120)

    async def one(index: int) -> tuple[str, str | None]:
        stream = await aclient.chat.completions.create(
            model=MODEL_NAME, messages=image_message(images[index % 4]), stream=True, **GREEDY)
        parts, finish = [], None
        async for chunk in stream:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        return "".join(parts), finish

    async def run_all():
        try:
            return await asyncio.gather(*(one(index) for index in range(32)))
        finally:
            await aclient.close()

    results = asyncio.run(run_all())
    assert [text for text, _ in results] == [expected[index % 4] for index in range(32)]
    assert all(finish == "length" for _, finish in results)


class _FailingEngine:
    """Real config and tokenizer; generate() fails the way AsyncLLM can."""

    def __init__(self, engine, failure: str) -> None:
        self.engine_config, self.tokenizer = engine.engine_config, engine.tokenizer
        self.failure = failure

    async def generate(self, prompt, sampling_params, request_id, *, stream=True):
        if self.failure == "overloaded":
            raise EngineOverloadedError("8 requests are in flight; retry later")
        completion = CompletionOutput(0, "", [], None, None, finish_reason="error")
        yield RequestOutput(request_id, None, [1, 2], [completion], True, error="worker died")

    async def abort(self, request_id):
        pass


def test_overloaded_engine_is_503_and_engine_failure_is_500(shared_engine, checkpoint):
    from fastapi.testclient import TestClient

    config = ServerConfig(served_model_names=(MODEL_NAME,), model_path=checkpoint)
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(build_app(_FailingEngine(shared_engine, "overloaded"), config)) as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 503 and "retry later" in response.json()["error"]["message"]
    with TestClient(build_app(_FailingEngine(shared_engine, "error"), config)) as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 500 and "worker died" in response.json()["error"]["message"]
        streamed = http.post("/v1/chat/completions", json={**body, "stream": True})
        assert '"code":500' in streamed.text and streamed.text.endswith("data: [DONE]\n\n")


def test_serve_flags_become_the_server_config(tmp_path):
    from foveal.entrypoints.cli import build_parser
    from foveal.entrypoints.serve import server_config
    from foveal.errors import ConfigError

    def parse(*flags):
        return build_parser().parse_args(["serve", "/models/x", *flags])

    args = parse("--served-model-name", "a", "b", "--api-key", "k", "--port", "9001",
                 "--allowed-local-media-path", str(tmp_path), "--media-fetch-timeout", "2.5",
                 "--max-media-bytes", "1000", "--max-model-len", "512")
    config = server_config(args, "/models/x")
    assert (config.served_model_names, config.security.api_keys, args.port) == (
        ("a", "b"), ("k",), 9001)
    assert config.media.allowed_local_media_path == str(tmp_path)
    assert (config.media.timeout_s, config.media.max_bytes) == (2.5, 1000)
    assert args.max_model_len == 512 and args.host == "127.0.0.1"
    assert server_config(parse(), "/models/x").served_model_names == ("/models/x",)
    with pytest.raises(ConfigError, match="is not a folder"):
        server_config(parse("--allowed-local-media-path", str(tmp_path / "nope")), "/models/x")


def test_speculative_decoding_with_int8_kv_streams_the_same_tokens(checkpoint):
    """The server with an int8 KV cache and n-gram drafts: streamed and whole answers equal
    the offline engine's without speculation; a request may opt out; metrics show drafts."""
    from foveal import LLM, SamplingParams

    options = {"kv_cache_dtype": "int8"}
    engine = make_engine(checkpoint, **options, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3})
    messages = [{"role": "user", "content": "red green blue red green blue red green"}]
    greedy = {"temperature": 0.0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}
    try:
        with serving(engine, checkpoint) as live:
            client = openai.OpenAI(base_url=live.base_url + "/v1", api_key="none")
            whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, **greedy)
            streamed = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                                      stream=True, **greedy)
            streamed_text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed)
            drafted = engine_stats(live.base_url)["foveal:spec_decode_num_draft_tokens_total"]
            opted_out = client.chat.completions.create(
                model=MODEL_NAME, messages=messages, temperature=0.0, max_tokens=24,
                extra_body={"ignore_eos": True, "speculative_decoding": False})
            stats = engine_stats(live.base_url)
    finally:
        engine.shutdown()
    llm = LLM(model=checkpoint, **{**ENGINE_OPTIONS, **options})
    offline = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].text
    llm.llm_engine.shutdown()
    assert streamed_text == whole.choices[0].message.content == offline
    assert opted_out.choices[0].message.content == offline
    assert drafted > 0 and stats["foveal:spec_decode_num_draft_tokens_total"] == drafted
    assert stats["foveal:spec_decode_num_accepted_tokens_total"] > 0
    assert stats['foveal:kv_cache_info{kv_cache_dtype="int8"}'] == 1
