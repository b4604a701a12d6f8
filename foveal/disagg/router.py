"""The router in front of disaggregated serving: one OpenAI-compatible endpoint
that runs each request through encode -> prefill -> decode workers.

Per request (`/v1/chat/completions`, `/v1/completions`), the client's JSON
body goes to the same path on each stage, plus:
1. encode (chat with image_url / video_url parts, and an encode pool):
   `"stream": false`, no `stream_options`; answers `{"ec_transfer_params": ...}`.
2. prefill (when the prefill pool has workers): `"kv_transfer_params":
   {"do_remote_decode": true}`, the encode's `ec_transfer_params`, `"stream":
   false`, `"max_tokens": 1`, no `max_completion_tokens` / `stream_options`;
   answers a completion with top-level `"kv_transfer_params"`.
3. decode: the client's body plus the prefill's `kv_transfer_params`; its
   answer, JSON or SSE, is relayed as is.

Faults: a worker that refuses, times out or answers 5xx before any byte
reached the client is marked failed and the stage retried elsewhere (a decode
retry reruns prefill for fresh KV); a 4xx goes back to the client as is. An
encode or prefill pool with no worker left is skipped (the next stage computes
that part itself); a decode pool with none left is a 503 naming it. A decode
stream that breaks after tokens were sent ends with an SSE error event and
`data: [DONE]`. Every wait is bounded: per connect, per stage and per request.
Torch-free.
"""
from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager
from http import HTTPStatus

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import generate_latest

from foveal.disagg.pools import (RouterConfig, PoolMetrics, RouterPools, Worker, WorkerPool, check_health,
                                 media_keys, monitor_health, normalize_worker_url, prefix_keys,
                                 probe_health)
from foveal.entrypoints.openai.errors import error_body
from foveal.entrypoints.openai.security import OpenRoutes, install_security
from foveal.errors import ConfigError, FovealError
from foveal.logger import init_logger

logger = init_logger(__name__)

CHAT_PATH, COMPLETION_PATH = "/v1/chat/completions", "/v1/completions"
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_INJECTED_FIELDS = ("kv_transfer_params", "ec_transfer_params")


class PoolUnavailableError(FovealError):
    """No worker of a pool could serve a stage: the pool is empty, all its
    workers are down, or each one tried failed (HTTP 503)."""

    def __init__(self, pool: WorkerPool, reason: str) -> None:
        healthy = len(pool.healthy_workers())
        super().__init__(f"no {pool.role} worker could serve the request ({reason}; the pool has "
                         f"{len(pool)} worker(s), {healthy} healthy); add {pool.role} workers "
                         f"(--{pool.role} or POST /router/workers) or retry later")


class _WorkerFailed(Exception):
    """The worker, not the request, failed: retry the stage on another worker."""


class _WorkerRejected(Exception):
    """A 4xx answer: the request's own fault, returned to the client as is."""

    def __init__(self, upstream: httpx.Response, content: bytes) -> None:
        self.response = Response(content, upstream.status_code, headers=_content_type(upstream))


def _content_type(upstream: httpx.Response) -> dict[str, str]:
    return {"content-type": upstream.headers.get("content-type", "application/json")}


def error_json(message: str, status: HTTPStatus) -> dict:
    body = error_body(message, status)
    if status == HTTPStatus.SERVICE_UNAVAILABLE:
        body["error"]["type"] = "ServiceUnavailable"
    return body


def error_response(message: str, status: HTTPStatus) -> JSONResponse:
    return JSONResponse(error_json(message, status), status_code=int(status))


def _describe(error: Exception) -> str:
    if isinstance(error, httpx.TimeoutException):
        return f"timed out ({type(error).__name__})"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class _RelayedStream(StreamingResponse):
    """A decode worker's SSE stream on its way to the client. However the
    stream ends (done, broken, client gone) the upstream connection is closed,
    which aborts the request on the worker, and the worker's slot is freed."""

    def __init__(self, chunks, upstream: httpx.Response, on_close) -> None:
        super().__init__(chunks, upstream.status_code, headers=_content_type(upstream))
        self._upstream, self._on_close = upstream, on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await _close(self._upstream)
            self._on_close()


async def _close(upstream: httpx.Response) -> None:
    """Closes a worker's response even while the caller is being cancelled
    (client gone, request timeout): an unread close aborts it on the worker."""
    with anyio.CancelScope(shield=True):
        await upstream.aclose()


def _sse_events(buffer: bytearray, chunk: bytes) -> bytes:
    """Appends `chunk` and pops the complete SSE events (through their blank line)."""
    buffer += chunk
    cut = max((buffer.rfind(blank) + len(blank) for blank in (b"\n\n", b"\r\n\r\n") if blank in buffer),
              default=0)
    events = bytes(buffer[:cut])
    del buffer[:cut]
    return events


class RequestRelay:
    """Runs requests through the stages; owns the HTTP client (set in the lifespan)."""

    def __init__(self, pools: RouterPools, config: RouterConfig, metrics: PoolMetrics) -> None:
        self.pools, self.config, self.metrics = pools, config, metrics
        self.client: httpx.AsyncClient | None = None

    def open_client(self) -> None:
        timeout = httpx.Timeout(self.config.stage_timeout_s, connect=self.config.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)

    async def serve(self, path: str, body: dict) -> Response:
        """The client's answer for one completion request; never raises."""
        injected = [field for field in _INJECTED_FIELDS if field in body]
        if injected:
            return error_response(f"{', '.join(injected)} is set by the router between its workers; "
                                  "remove it from the request", HTTPStatus.BAD_REQUEST)
        deadline = time.monotonic() + self.config.request_timeout_s
        try:
            with anyio.fail_after(self.config.request_timeout_s):
                ec_params = await self._encode(path, body)
                return await self._prefill_and_decode(path, body, ec_params, deadline)
        except _WorkerRejected as rejected:
            return rejected.response
        except PoolUnavailableError as error:
            return error_response(str(error), HTTPStatus.SERVICE_UNAVAILABLE)
        except TimeoutError:
            return error_response(f"the request took longer than {self.config.request_timeout_s:g} s "
                                  "(--request-timeout)", HTTPStatus.SERVICE_UNAVAILABLE)

    async def _encode(self, path: str, body: dict) -> dict | None:
        """The encode stage's ec_transfer_params (None: no media or no encode pool)."""
        keys = media_keys(body) if path == CHAT_PATH else []
        if not keys or not len(self.pools.encode):
            return None
        encode_body = {**body, "stream": False}
        encode_body.pop("stream_options", None)
        try:
            answer = await self._run_json_stage(self.pools.encode, keys, path, encode_body,
                                                "ec_transfer_params")
        except PoolUnavailableError as error:  # the prefill worker encodes instead
            logger.warning("%s; the prefill stage encodes this request's media", error)
            return None
        return answer["ec_transfer_params"]

    async def _prefill(self, path: str, body: dict, ec_params: dict | None) -> dict | None:
        """The prefill stage's kv_transfer_params (None: no prefill pool)."""
        if not len(self.pools.prefill):
            return None
        prefill_body = {**body, "kv_transfer_params": {"do_remote_decode": True},
                        "stream": False, "max_tokens": 1}
        for field in ("max_completion_tokens", "stream_options"):
            prefill_body.pop(field, None)
        if ec_params is not None:
            prefill_body["ec_transfer_params"] = ec_params
        try:
            answer = await self._run_json_stage(self.pools.prefill, prefix_keys(body), path,
                                                prefill_body, "kv_transfer_params")
        except PoolUnavailableError as error:  # a decode worker serves whole requests too
            logger.warning("%s; the decode stage prefills this request", error)
            return None
        return answer["kv_transfer_params"]

    async def _run_json_stage(self, pool: WorkerPool, keys: list[str], path: str, body: dict,
                              required_field: str) -> dict:
        tried: list[str] = []
        reason = "no healthy worker"
        for attempt in range(self.config.max_attempts):
            worker = pool.choose(keys, exclude=tried)
            if worker is None:
                break
            tried.append(worker.url)
            self._count_attempt(pool, attempt)
            pool.begin(worker)
            try:
                answer = await self._post_json(worker, path, body, required_field)
            except _WorkerFailed as error:
                reason = self._fail(pool, worker, str(error))
                continue
            finally:
                pool.finish(worker)
            worker.served += 1
            return answer
        raise PoolUnavailableError(pool, reason)

    async def _prefill_and_decode(self, path: str, body: dict, ec_params: dict | None,
                                  deadline: float) -> Response:
        if not len(self.pools.decode):
            raise PoolUnavailableError(self.pools.decode, "the decode pool is empty")
        pool, tried = self.pools.decode, []
        reason = "no healthy worker"
        for attempt in range(self.config.max_attempts):
            if all(worker.url in tried for worker in pool.healthy_workers()):
                break
            # KV is handed over once: a decode retry needs a fresh prefill
            kv_params = await self._prefill(path, body, ec_params)
            worker = pool.choose(exclude=tried)  # after prefill: the load is current
            if worker is None:
                break
            decode_body = dict(body)
            if kv_params is not None:
                decode_body["kv_transfer_params"] = kv_params
            elif ec_params is not None:  # no prefill stage: the decode worker prefills
                decode_body["ec_transfer_params"] = ec_params
            tried.append(worker.url)
            self._count_attempt(pool, attempt)
            try:
                return await self._decode(worker, path, decode_body, deadline)
            except _WorkerFailed as error:
                reason = self._fail(pool, worker, str(error))
        raise PoolUnavailableError(pool, reason)

    async def _decode(self, worker: Worker, path: str, body: dict, deadline: float) -> Response:
        pool = self.pools.decode
        pool.begin(worker)
        upstream, handed_over = None, False
        try:
            upstream = await self._open(worker, path, body)
            if not body.get("stream"):
                content = await self._read(worker, upstream)
                worker.served += 1
                return Response(content, upstream.status_code, headers=_content_type(upstream))
            chunks = upstream.aiter_bytes()
            try:
                first = await anext(chunks)
            except (httpx.HTTPError, StopAsyncIteration) as error:
                raise _WorkerFailed(f"{worker.url} closed its stream before the first event: "
                                    f"{_describe(error)}") from None
            handed_over = True  # the stream closes upstream and frees the worker's slot
            return _RelayedStream(self._relay(worker, first, chunks, deadline), upstream,
                                  on_close=lambda: pool.finish(worker))
        finally:
            if not handed_over:
                if upstream is not None:
                    await _close(upstream)
                pool.finish(worker)

    async def _relay(self, worker: Worker, first: bytes, chunks, deadline: float):
        """Whole SSE events as they arrive; a break after the first ends the
        client's stream with an error event, since tokens were already sent."""
        buffer = bytearray()
        events = _sse_events(buffer, first)
        if events:
            yield events
        try:
            while True:
                with anyio.fail_after(max(0.0, deadline - time.monotonic())):
                    chunk = await anext(chunks, None)
                if chunk is None:
                    break
                events = _sse_events(buffer, chunk)
                if events:
                    yield events
        except (httpx.HTTPError, TimeoutError) as error:
            if isinstance(error, TimeoutError):
                message = (f"the request ran past {self.config.request_timeout_s:g} s "
                           f"(--request-timeout) mid-stream on decode worker {worker.url}")
            else:
                message = (f"decode worker {worker.url} failed mid-stream "
                           f"({self._fail(self.pools.decode, worker, _describe(error))})")
            error_event = json.dumps(error_json(message + "; the answer is incomplete",
                                                HTTPStatus.SERVICE_UNAVAILABLE))
            yield f"data: {error_event}\n\ndata: [DONE]\n\n".encode()
            return
        if buffer:
            yield bytes(buffer)
        worker.served += 1

    async def _open(self, worker: Worker, path: str, body: dict) -> httpx.Response:
        """POSTs `body`; returns the 2xx response unread (streaming), raises
        _WorkerFailed on a transport error or 5xx, _WorkerRejected on 4xx."""
        request = self.client.build_request("POST", worker.url + path, json=body)
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.HTTPError as error:
            raise _WorkerFailed(f"{worker.url}{path}: {_describe(error)}") from None
        if upstream.status_code < 400:
            return upstream
        content = await self._read(worker, upstream)
        if upstream.status_code >= 500:
            excerpt = content[:200].decode(errors="replace")
            raise _WorkerFailed(f"{worker.url}{path} answered HTTP {upstream.status_code}: {excerpt}")
        raise _WorkerRejected(upstream, content)

    async def _read(self, worker: Worker, upstream: httpx.Response) -> bytes:
        try:
            return await upstream.aread()
        except httpx.HTTPError as error:
            raise _WorkerFailed(f"{worker.url}: the answer broke off: {_describe(error)}") from None
        finally:
            await _close(upstream)

    async def _post_json(self, worker: Worker, path: str, body: dict, required_field: str) -> dict:
        upstream = await self._open(worker, path, body)
        content = await self._read(worker, upstream)
        try:
            answer = json.loads(content)
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or not isinstance(answer.get(required_field), dict):
            raise _WorkerFailed(f"{worker.url}{path} answered without a {required_field} object; "
                                "is it a `foveal serve --role` worker of this pool?")
        return answer

    def _count_attempt(self, pool: WorkerPool, attempt: int) -> None:
        self.metrics.requests.labels(pool=pool.role).inc()
        if attempt:
            self.metrics.retries.labels(pool=pool.role).inc()

    def _fail(self, pool: WorkerPool, worker: Worker, reason: str) -> str:
        logger.warning("%s worker %s is out of rotation until healthy: %s", pool.role, worker.url, reason)
        pool.mark_failed(worker)
        self.metrics.failures.labels(pool=pool.role).inc()
        return reason

    async def models(self) -> Response:
        """GET /v1/models of the first healthy decode (else prefill) worker that answers."""
        for worker in self.pools.decode.healthy_workers() + self.pools.prefill.healthy_workers():
            try:
                upstream = await self.client.get(worker.url + "/v1/models")
            except httpx.HTTPError:
                continue
            return Response(upstream.content, upstream.status_code, headers=_content_type(upstream))
        return error_response("no healthy decode or prefill worker to list the models of",
                              HTTPStatus.SERVICE_UNAVAILABLE)


class _ClientError(Exception):
    """The router's own 4xx answer (bad body, wrong key)."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


async def _json_object(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except ValueError as error:
        raise _ClientError(f"request body is not valid JSON ({error})") from None
    if not isinstance(body, dict):
        raise _ClientError("request body must be a JSON object")
    return body


def build_router_app(config: RouterConfig, pools: RouterPools | None = None) -> FastAPI:
    """The router's app. pools: start from these (tests); default: built from config."""
    if pools is None:
        pools = RouterPools(config.encode, config.prefill, config.decode,
                            cache_entries=config.cache_entries, load_slack=config.cache_load_slack)
    metrics = PoolMetrics(pools)
    relay = RequestRelay(pools, config, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        relay.open_client()
        health = (pools, relay.client, config.connect_timeout_s, config.remove_after_s)
        await check_health(*health)  # know who is up before the first request
        checker = asyncio.create_task(monitor_health(*health, interval_s=config.health_interval_s))
        try:
            yield
        finally:
            checker.cancel()
            await relay.client.aclose()

    app = FastAPI(title="Foveal disaggregated-serving router", lifespan=lifespan)
    # keys, per-key limits and the body cap as on a worker; /health and /metrics stay open
    install_security(app, config.security, OpenRoutes(paths=frozenset({"/health", "/metrics"})))
    app.state.pools, app.state.relay = pools, relay

    @app.exception_handler(_ClientError)
    async def client_error(_: Request, error: _ClientError) -> JSONResponse:
        return error_response(str(error), error.status)

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request) -> Response:
        return await relay.serve(CHAT_PATH, await _json_object(request))

    @app.post(COMPLETION_PATH)
    async def completions(request: Request) -> Response:
        return await relay.serve(COMPLETION_PATH, await _json_object(request))

    @app.get("/v1/models")
    async def models() -> Response:
        return await relay.models()

    @app.get("/health")
    async def health() -> Response:
        if pools.decode.healthy_workers():
            return Response(status_code=HTTPStatus.OK)
        return error_response("no healthy decode worker", HTTPStatus.SERVICE_UNAVAILABLE)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=METRICS_CONTENT_TYPE)

    _add_worker_routes(app, pools, relay)
    return app


def _add_worker_routes(app: FastAPI, pools: RouterPools, relay: RequestRelay) -> None:
    async def worker_ref(request: Request) -> tuple[WorkerPool, str]:
        body = await _json_object(request)
        try:
            return pools[body.get("role")], normalize_worker_url(body.get("url"))
        except ConfigError as error:
            raise _ClientError(f"{error} (body: {{\"role\": \"encode|prefill|decode\", "
                              "\"url\": \"http://host:port\"})") from None

    @app.get("/router/workers")
    async def list_workers() -> JSONResponse:
        return JSONResponse(pools.describe())

    @app.post("/router/workers")
    async def register_worker(request: Request) -> JSONResponse:
        pool, url = await worker_ref(request)
        if not await probe_health(relay.client, url, relay.config.connect_timeout_s):
            return error_response(f"{url}/health did not answer 200 within "
                                  f"{relay.config.connect_timeout_s:g} s (--connect-timeout); "
                                  "register a worker once it serves", HTTPStatus.BAD_REQUEST)
        worker = pool.add(url, healthy=True)
        logger.info("registered %s worker %s", pool.role, url)
        return JSONResponse({"role": pool.role, **worker.describe()})

    @app.delete("/router/workers")
    async def deregister_worker(request: Request) -> JSONResponse:
        pool, url = await worker_ref(request)
        worker = pool.remove(url)
        if worker is None:
            return error_response(f"no {pool.role} worker {url} is registered",
                                  HTTPStatus.NOT_FOUND)
        logger.info("deregistered %s worker %s", pool.role, url)
        return JSONResponse({"role": pool.role, **worker.describe()})

