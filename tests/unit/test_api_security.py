"""The server's access rules without a server: which routes are open, API keys
checked against every key, the per-client token bucket and in-flight count on a
fake clock, and the body limit's replay of a chunked body."""
from __future__ import annotations

import asyncio
import hmac

import pytest

from foveal.entrypoints.openai import security
from foveal.entrypoints.openai.security import (CLIENT_SCOPE_KEY, APIKeyMiddleware,
                                                BodySizeLimitMiddleware, ClientLimits,
                                                OpenRoutes, TokenBucket, api_keys_from)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def http_scope(path: str = "/v1/models", method: str = "GET", headers=()) -> dict:
    return {"type": "http", "method": method, "path": path, "headers": list(headers),
            "client": ("10.1.2.3", 5555)}


def call(middleware, scope: dict, body_messages=()) -> tuple[list[dict], dict]:
    """Runs one request through `middleware`; returns what it sent and the scope."""
    pending, sent = list(body_messages), []

    async def receive() -> dict:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(middleware(scope, receive, send))
    return sent, scope


class EchoApp:
    """An ASGI app that answers 200 with the request body it read."""

    def __init__(self) -> None:
        self.scopes = []

    async def __call__(self, scope, receive, send) -> None:
        self.scopes.append(scope)
        body, message = b"", {"more_body": True}
        while message.get("more_body"):
            message = await receive()
            body += message.get("body", b"")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


def test_open_routes_admit_health_metrics_version_and_listed_static_paths():
    default = OpenRoutes()
    assert all(default.admits("GET", path) for path in ("/health", "/metrics", "/version"))
    assert default.admits("OPTIONS", "/v1/chat/completions")
    assert not default.admits("GET", "/") and not default.admits("GET", "/v1/models")
    ui = OpenRoutes(get_paths=frozenset({"/"}), get_prefixes=("/playground/",))
    assert ui.admits("GET", "/") and ui.admits("HEAD", "/playground/app.js")
    assert not ui.admits("POST", "/playground/app.js")
    assert not ui.admits("GET", "/playground/../v1/models")
    assert not ui.admits("GET", "/playgroundx") and not ui.admits("GET", "/v1/models")


def test_api_key_is_compared_with_every_key_and_names_the_one_that_matched(monkeypatch):
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(security.hmac, "compare_digest",
                        lambda a, b: compared.append(b) or real(a, b))
    app = EchoApp()
    middleware = APIKeyMiddleware(app, ("k1", "k2", "k3"))
    for key, client in (("k1", "API key #1"), ("k3", "API key #3")):
        compared.clear()
        sent, scope = call(middleware, http_scope(headers=[(b"authorization",
                                                            f"Bearer {key}".encode())]))
        assert sent[0]["status"] == 200 and scope[CLIENT_SCOPE_KEY] == client
        assert len(compared) == 3
    compared.clear()
    sent, _ = call(middleware, http_scope(headers=[(b"authorization", b"Bearer k4")]))
    assert sent[0]["status"] == 401 and len(compared) == 3
    sent, _ = call(middleware, http_scope("/health"))
    assert sent[0]["status"] == 200 and len(app.scopes) == 3


def test_api_keys_come_from_the_flags_else_the_environment():
    assert api_keys_from(["a", "b"], {"FOVEAL_API_KEY": "env"}) == ("a", "b")
    assert api_keys_from(None, {"FOVEAL_API_KEY": "env"}) == ("env",)
    assert api_keys_from(None, {}) == () == api_keys_from(None, {"FOVEAL_API_KEY": ""})


def test_token_bucket_allows_a_minute_of_burst_then_refills_at_the_rate():
    bucket = TokenBucket(rpm=60, now=0.0)
    assert all(bucket.take(0.0) == 0.0 for _ in range(60))
    assert bucket.take(0.0) == pytest.approx(1.0)
    assert bucket.take(0.5) == pytest.approx(0.5)
    assert bucket.take(1.0) == 0.0
    assert bucket.take(1000.0) == 0.0 and bucket.tokens == 59  # never more than rpm saved


def test_client_limits_refuse_by_rate_and_by_requests_in_flight_per_client():
    clock = FakeClock()
    limits = ClientLimits(rate_limit_rpm=2, max_concurrent=1, clock=clock)
    assert limits.admit("a") is None
    message, retry_after = limits.admit("a")
    assert "1 requests in flight" in message and retry_after == 1
    assert limits.admit("b") is None  # another client
    limits.release("a")
    assert limits.admit("a") is None
    limits.release("a")
    message, retry_after = limits.admit("a")
    assert "--rate-limit-rpm" in message and retry_after == 30
    clock.now += 30
    assert limits.admit("a") is None


def test_idle_clients_are_forgotten_once_many_are_tracked(monkeypatch):
    monkeypatch.setattr(security, "_MAX_TRACKED_CLIENTS", 2)
    clock = FakeClock()
    limits = ClientLimits(rate_limit_rpm=1, max_concurrent=None, clock=clock)
    assert limits.admit("old") is None and limits.admit("other") is None
    clock.now += 59  # "old" and "other" have not refilled yet
    assert limits.admit("new") is None and len(limits._buckets) == 3
    clock.now += 60
    assert limits.admit("newest") is None
    assert set(limits._buckets) == {"newest"}


def test_body_limit_refuses_by_declared_length_before_reading():
    app = EchoApp()
    middleware = BodySizeLimitMiddleware(app, max_bytes=10)
    scope = http_scope("/v1/completions", "POST", [(b"content-length", b"11")])
    sent, _ = call(middleware, scope, [{"type": "http.request", "body": b"x" * 11}])
    assert sent[0]["status"] == 413 and b"--max-request-bytes" in sent[1]["body"]
    assert app.scopes == []


def test_body_limit_counts_a_chunked_body_and_replays_it_when_small_enough():
    app = EchoApp()
    middleware = BodySizeLimitMiddleware(app, max_bytes=10)
    chunks = [{"type": "http.request", "body": b"abcd", "more_body": True},
              {"type": "http.request", "body": b"efgh", "more_body": False}]
    sent, _ = call(middleware, http_scope("/v1/completions", "POST"), chunks)
    assert (sent[0]["status"], sent[1]["body"]) == (200, b"abcdefgh")
    too_big = chunks[:1] * 3
    sent, _ = call(middleware, http_scope("/v1/completions", "POST"), too_big)
    assert sent[0]["status"] == 413 and len(app.scopes) == 1
