"""The server's security rules end to end on the tiny checkpoint, through a live
server with httpx and the official `openai` client: several API keys, per-key rate
and concurrency limits (429 + Retry-After), the request body limit (413, declared
and chunked) and media URLs refused for reaching the server's own network (400)."""
from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from http.server import BaseHTTPRequestHandler

import httpx
import openai
import pytest
from test_openai_server import MODEL_NAME, data_url, image_message, make_engine, png_bytes, serving

from foveal.entrypoints.openai.security import SecurityConfig
from foveal.multimodal.media.fetch import MediaFetchConfig
from tests.unit.test_media_fetch import loopback_http_server, media_http_server

KEYS = ("alpha-key", "beta-key-that-is-longer")
HELLO = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}],
         "max_tokens": 2, "temperature": 0.0}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def engine(checkpoint):
    engine = make_engine(checkpoint)
    yield engine
    engine.shutdown()


def secured(engine, checkpoint, media: MediaFetchConfig | None = None, **security):
    return serving(engine, checkpoint, security=SecurityConfig(**security), media=media)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def client_for(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key, max_retries=0,
                         timeout=60)


def assert_openai_error(response: httpx.Response, status: int, error_type: str, fragment: str):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == (error_type, status)
    assert fragment in error["message"], error["message"]
    assert "Traceback" not in response.text


def test_every_configured_key_is_accepted_and_others_are_401(engine, checkpoint):
    with secured(engine, checkpoint, api_keys=KEYS) as server:
        for key in KEYS:
            assert [model.id for model in client_for(server, key).models.list().data] == [
                MODEL_NAME]
            reply = client_for(server, key).chat.completions.create(**HELLO)
            assert reply.usage.completion_tokens == 2
        for key in ("wrong", KEYS[0][:-1], KEYS[0] + "x", f"{KEYS[0]},{KEYS[1]}"):
            with pytest.raises(openai.AuthenticationError):
                client_for(server, key).models.list()
        unkeyed = httpx.post(f"{server.base_url}/v1/chat/completions", json=HELLO)
        assert_openai_error(unkeyed, 401, "authentication_error", "--api-key")
        for path in ("/health", "/metrics", "/version"):
            assert httpx.get(server.base_url + path).status_code == 200, path


def test_rate_limit_is_per_key_and_answers_429_with_retry_after(engine, checkpoint):
    with secured(engine, checkpoint, api_keys=KEYS, rate_limit_rpm=2) as server:
        first = client_for(server, KEYS[0])
        for _ in range(2):
            assert first.models.list().data[0].id == MODEL_NAME
        with pytest.raises(openai.RateLimitError):
            first.models.list()
        refused = httpx.get(f"{server.base_url}/v1/models", headers=bearer(KEYS[0]))
        assert_openai_error(refused, 429, "rate_limit_error", "--rate-limit-rpm")
        assert 1 <= int(refused.headers["Retry-After"]) <= 30
        assert client_for(server, KEYS[1]).models.list().data[0].id == MODEL_NAME
        assert all(httpx.get(server.base_url + "/health").status_code == 200 for _ in range(3))


def test_without_keys_the_limits_apply_per_client_address(engine, checkpoint):
    with secured(engine, checkpoint, rate_limit_rpm=1) as server:
        assert httpx.get(f"{server.base_url}/v1/models").status_code == 200
        refused = httpx.get(f"{server.base_url}/v1/models")
        assert_openai_error(refused, 429, "rate_limit_error", "client 127.0.0.1")
        assert "Retry-After" in refused.headers


class _HeldImageHandler(BaseHTTPRequestHandler):
    """GET answers a PNG once the test sets `release`; `arrived` is set on each GET."""

    arrived, release = threading.Event(), threading.Event()

    def do_GET(self) -> None:  # noqa: N802 (http.server's spelling)
        type(self).arrived.set()
        type(self).release.wait(timeout=60)
        body = png_bytes()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def test_concurrency_limit_refuses_a_second_request_in_flight(engine, checkpoint):
    """The first request waits on its image (held by the media server) while the next
    ones arrive, so it is in flight for certain."""
    media = MediaFetchConfig(timeout_s=60.0, max_bytes=200_000, allowed_media_domains=("127.0.0.1",))
    with secured(engine, checkpoint, media=media, api_keys=KEYS,
                 max_concurrent_per_key=1) as server, \
            loopback_http_server(_HeldImageHandler) as media_base, \
            httpx.Client(base_url=server.base_url, timeout=60) as http, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(http.post, "/v1/chat/completions", headers=bearer(KEYS[0]),
                           json={**HELLO, "messages": image_message(f"{media_base}/held.png")})
        assert _HeldImageHandler.arrived.wait(timeout=60)
        refused = http.post("/v1/chat/completions", json=HELLO, headers=bearer(KEYS[0]))
        assert_openai_error(refused, 429, "rate_limit_error", "--max-concurrent-per-key")
        assert refused.headers["Retry-After"] == "1"
        other_key = http.post("/v1/chat/completions", json=HELLO, headers=bearer(KEYS[1]))
        assert other_key.status_code == 200, other_key.text
        _HeldImageHandler.release.set()
        assert held.result().status_code == 200, held.result().text
        # The slot frees when the server has finished the answer, just after the client has it.
        statuses = []
        for _ in range(200):
            statuses.append(http.get("/v1/models", headers=bearer(KEYS[0])).status_code)
            if statuses[-1] != 429:
                break
            time.sleep(0.05)
        assert statuses[-1] == 200, statuses


def _chunks(body: bytes, size: int = 8 * 1024):
    for start in range(0, len(body), size):
        yield body[start:start + size]


def test_bodies_over_the_limit_are_413_declared_or_chunked(engine, checkpoint):
    limit = 64 * 1024
    big = json.dumps({**HELLO, "messages": image_message(data_url(b"x" * 90_000))}).encode()
    small = json.dumps({**HELLO, "messages": image_message(data_url(png_bytes()))}).encode()
    headers = {"content-type": "application/json"}
    with secured(engine, checkpoint, max_request_bytes=limit) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as http:
        declared = http.post("/v1/chat/completions", content=big, headers=headers)
        assert_openai_error(declared, 413, "invalid_request_error", "--max-request-bytes")
        assert f"request body is {len(big)} bytes" in declared.json()["error"]["message"]
    with secured(engine, checkpoint, max_request_bytes=limit) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as http:
        chunked = http.post("/v1/chat/completions", content=_chunks(big), headers=headers)
        assert_openai_error(chunked, 413, "invalid_request_error", f"limit is {limit} bytes")
    with secured(engine, checkpoint, max_request_bytes=limit) as server, \
            httpx.Client(base_url=server.base_url, timeout=60) as http:
        replayed = http.post("/v1/chat/completions", content=_chunks(small), headers=headers)
        assert replayed.status_code == 200, replayed.text
        assert replayed.json()["usage"]["prompt_tokens_details"]["image_tokens"] > 0


def test_media_urls_reaching_the_server_network_are_400(engine, checkpoint):
    media = MediaFetchConfig(timeout_s=2.0, max_bytes=200_000)
    with secured(engine, checkpoint, media=media, api_keys=KEYS) as server, \
            media_http_server() as media_base:
        port = media_base.rsplit(":", 1)[1]
        cases = [(f"{media_base}/ok.png", "loopback"), (f"http://localhost:{port}/ok.png",
                                                        "loopback"),
                 ("http://169.254.169.254/latest/meta-data/", "link-local"),
                 ("http://[::ffff:10.0.0.1]/cat.png", "private")]
        for url, kind in cases:
            response = httpx.post(f"{server.base_url}/v1/chat/completions",
                                  json={**HELLO, "messages": image_message(url)},
                                  headers=bearer(KEYS[0]), timeout=60)
            assert_openai_error(response, 400, "invalid_request_error", f"a {kind} address")
            assert "--allowed-media-domains" in response.json()["error"]["message"]
        with pytest.raises(openai.BadRequestError, match="--allow-private-media-urls"):
            client_for(server, KEYS[1]).chat.completions.create(
                **{**HELLO, "messages": image_message(f"{media_base}/ok.png")})


def test_allow_listed_media_host_is_fetched_through_the_server(engine, checkpoint):
    media = MediaFetchConfig(timeout_s=2.0, max_bytes=200_000, allowed_media_domains=("localhost",))
    with secured(engine, checkpoint, media=media) as server, media_http_server() as media_base:
        port = media_base.rsplit(":", 1)[1]
        reply = client_for(server, "unused").chat.completions.create(
            **{**HELLO, "messages": image_message(f"http://localhost:{port}/ok.png")})
        assert reply.usage.prompt_tokens_details.image_tokens > 0
        with pytest.raises(openai.BadRequestError, match="not in the server's allowed media"):
            client_for(server, "unused").chat.completions.create(
                **{**HELLO, "messages": image_message(f"{media_base}/ok.png")})


def test_security_flags_become_the_server_config(monkeypatch):
    from foveal.entrypoints.cli import build_parser
    from foveal.entrypoints.serve import server_config
    from foveal.errors import ConfigError

    def config_of(*flags):
        return server_config(build_parser().parse_args(["serve", "/m", *flags]), "/m")

    config = config_of("--api-key", "a", "--api-key", "b", "--rate-limit-rpm", "5",
                       "--max-concurrent-per-key", "2", "--max-request-bytes", "1000",
                       "--allowed-media-domains", "cdn.example.com", "example.org",
                       "--allow-private-media-urls")
    assert config.security == SecurityConfig(api_keys=("a", "b"), rate_limit_rpm=5,
                                             max_concurrent_per_key=2, max_request_bytes=1000)
    assert config.media.allowed_media_domains == ("cdn.example.com", "example.org")
    assert config.media.allow_private_media_urls
    monkeypatch.setenv("FOVEAL_API_KEY", "from-env")
    defaults = config_of()
    assert defaults.security == SecurityConfig(api_keys=("from-env",))
    assert defaults.security.max_request_bytes == 64 * 1024 * 1024
    assert (defaults.media.allowed_media_domains, defaults.media.allow_private_media_urls) == (
        None, False)
    assert config_of("--api-key", "flag").security.api_keys == ("flag",)
    for flags in (("--rate-limit-rpm", "0"), ("--max-concurrent-per-key", "-1"),
                  ("--max-request-bytes", "0"), ("--api-key", "")):
        with pytest.raises(ConfigError, match=flags[0]):
            config_of(*flags)
