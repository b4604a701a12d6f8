"""Who may call the server and how much: API keys, per-client limits and the request
body size limit, as plain ASGI middlewares (not BaseHTTPMiddleware, so streamed
responses pass untouched). `install_security(app, config)` puts them on an app,
outermost first:

1. `APIKeyMiddleware`: 'Authorization: Bearer KEY' against every configured key. The
   header and the keys are compared as SHA-256 digests with `hmac.compare_digest`,
   against all keys on every request, so neither an early exit nor the time taken
   tells which key matched or how long the keys are.
2. `ClientLimitsMiddleware`: per client (the key that matched; the client's IP when
   the server has no keys) a token bucket of `--rate-limit-rpm` requests per minute
   (a burst of up to one minute's worth) and at most `--max-concurrent-per-key`
   requests in flight (a streamed answer counts until its last chunk). Over either:
   429, a `Retry-After` header and error type "rate_limit_error".
3. `BodySizeLimitMiddleware`: 413 for a body over `--max-request-bytes`, refused on
   its Content-Length before any of it is read; a chunked body is read here while
   it arrives, counted, and replayed to the app.
Key and limits come first, so an unknown client, or one over its limits, never makes
the server read a body. `OPEN_ROUTES` pass without a key and outside the limits.
"""
from __future__ import annotations

import collections
import hashlib
import hmac
import math
import time
from dataclasses import dataclass
from http import HTTPStatus

from fastapi.responses import JSONResponse

from foveal.entrypoints.openai.errors import error_body
from foveal.entrypoints.security_args import SecurityConfig, api_keys_from  # noqa: F401 (re-export)

# Where the key middleware leaves the client's name for the limits middleware.
CLIENT_SCOPE_KEY = "foveal.client"
_MAX_TRACKED_CLIENTS = 10_000  # past this, idle clients' buckets are dropped


@dataclass(frozen=True)
class OpenRoutes:
    """Requests that need no API key and count against no client's limits: load
    balancers, scrapers and a browser loading static pages hold no secrets. Extend
    it for static UI with `get_paths={"/"}` and `get_prefixes=("/playground/",)`."""

    paths: frozenset[str] = frozenset({"/health", "/metrics", "/version"})  # any method
    get_paths: frozenset[str] = frozenset()  # GET / HEAD of exactly these paths
    get_prefixes: tuple[str, ...] = ()  # GET / HEAD of paths below these

    def admits(self, method: str, path: str) -> bool:
        if method == "OPTIONS" or path in self.paths:  # OPTIONS: CORS preflight
            return True
        if method not in ("GET", "HEAD") or ".." in path.split("/"):
            return False
        return path in self.get_paths or path.startswith(self.get_prefixes)


OPEN_ROUTES = OpenRoutes()


def install_security(app, config: SecurityConfig, open_routes: OpenRoutes = OPEN_ROUTES) -> None:
    """Starlette runs the middleware added last first: add them innermost first."""
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_request_bytes)
    if config.rate_limit_rpm or config.max_concurrent_per_key:
        limits = ClientLimits(config.rate_limit_rpm, config.max_concurrent_per_key)
        app.add_middleware(ClientLimitsMiddleware, limits=limits, open_routes=open_routes)
    if config.api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=config.api_keys, open_routes=open_routes)


async def _refuse(scope, receive, send, message: str, status: HTTPStatus,
                  error_type: str | None = None, headers: dict | None = None) -> None:
    body = error_body(message, status)
    if error_type:
        body["error"]["type"] = error_type
    await JSONResponse(body, status_code=int(status), headers=headers)(scope, receive, send)


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class APIKeyMiddleware:
    def __init__(self, app, api_keys: tuple[str, ...], open_routes: OpenRoutes = OPEN_ROUTES):
        self.app, self.open_routes = app, open_routes
        self._digests = [_digest(f"Bearer {key}".encode()) for key in api_keys]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.open_routes.admits(scope["method"], scope["path"]):
            return await self.app(scope, receive, send)
        given = _digest(dict(scope["headers"]).get(b"authorization", b""))
        matches = [hmac.compare_digest(given, digest) for digest in self._digests]
        if any(matches):
            scope[CLIENT_SCOPE_KEY] = f"API key #{matches.index(True) + 1}"
            return await self.app(scope, receive, send)
        await _refuse(scope, receive, send, "missing or wrong API key; send 'Authorization: "
                      "Bearer <key>' with a key the server was started with (--api-key)",
                      HTTPStatus.UNAUTHORIZED)


class TokenBucket:
    """`rpm` requests per minute, refilled continuously, up to `rpm` saved up."""

    def __init__(self, rpm: int, now: float) -> None:
        self.rpm, self.tokens, self.updated = rpm, float(rpm), now

    def refill(self, now: float) -> None:
        self.tokens = min(self.rpm, self.tokens + (now - self.updated) * self.rpm / 60)
        self.updated = now

    def take(self, now: float) -> float:
        """0.0 if a request may go now (its token taken), else seconds until one may."""
        self.refill(now)
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) * 60 / self.rpm


class ClientLimits:
    """Request rate and requests in flight per client name. `admit(client)` answers
    None (admitted: call `release(client)` when the request ends) or a refusal:
    (message, seconds to wait before retrying)."""

    def __init__(self, rate_limit_rpm: int | None, max_concurrent: int | None,
                 clock=time.monotonic) -> None:
        self.rate_limit_rpm, self.max_concurrent, self.clock = rate_limit_rpm, max_concurrent, clock
        self._buckets: dict[str, TokenBucket] = {}
        self._in_flight: collections.Counter[str] = collections.Counter()

    def admit(self, client: str) -> tuple[str, int] | None:
        now = self.clock()
        if self.max_concurrent and self._in_flight[client] >= self.max_concurrent:
            return (f"{client} has {self._in_flight[client]} requests in flight; the limit is "
                    f"{self.max_concurrent} (--max-concurrent-per-key)", 1)
        if self.rate_limit_rpm:
            if client not in self._buckets:
                self._forget_idle_clients(now)
                self._buckets[client] = TokenBucket(self.rate_limit_rpm, now)
            wait_s = self._buckets[client].take(now)
            if wait_s > 0:
                return (f"{client} is over {self.rate_limit_rpm} requests per minute "
                        f"(--rate-limit-rpm); retry in {math.ceil(wait_s)} s", math.ceil(wait_s))
        self._in_flight[client] += 1
        return None

    def release(self, client: str) -> None:
        self._in_flight[client] -= 1
        if self._in_flight[client] <= 0:
            del self._in_flight[client]

    def _forget_idle_clients(self, now: float) -> None:
        # A full bucket is the same as a new one: dropping it changes nothing.
        if len(self._buckets) < _MAX_TRACKED_CLIENTS:
            return
        for client, bucket in list(self._buckets.items()):
            bucket.refill(now)
            if bucket.tokens >= bucket.rpm:
                del self._buckets[client]


class ClientLimitsMiddleware:
    def __init__(self, app, limits: ClientLimits, open_routes: OpenRoutes = OPEN_ROUTES):
        self.app, self.limits, self.open_routes = app, limits, open_routes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.open_routes.admits(scope["method"], scope["path"]):
            return await self.app(scope, receive, send)
        client = scope.get(CLIENT_SCOPE_KEY) or f"client {(scope.get('client') or ('?',))[0]}"
        refusal = self.limits.admit(client)
        if refusal is not None:
            message, retry_after_s = refusal
            return await _refuse(scope, receive, send, message, HTTPStatus.TOO_MANY_REQUESTS,
                                 "rate_limit_error", {"Retry-After": str(retry_after_s)})
        try:
            await self.app(scope, receive, send)
        finally:
            self.limits.release(client)


class BodySizeLimitMiddleware:
    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            # The HTTP server frames the body by this length: it cannot grow past it.
            if declared.isdigit() and int(declared) > self.max_bytes:
                return await self._refuse(scope, receive, send, int(declared))
            return await self.app(scope, receive, send)
        messages, num_bytes = collections.deque(), 0
        while True:  # chunked (or no) body: read it here, counting, then replay it
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            num_bytes += len(message.get("body", b""))
            if num_bytes > self.max_bytes:
                return await self._refuse(scope, receive, send, num_bytes)
            if not message.get("more_body"):
                break

        async def replay():
            return messages.popleft() if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, num_bytes: int) -> None:
        await _refuse(scope, receive, send, f"request body is {num_bytes} bytes or more; the "
                      f"limit is {self.max_bytes} bytes (--max-request-bytes)",
                      HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
