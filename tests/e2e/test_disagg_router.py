"""The disaggregated-serving router end to end, over live HTTP: the router and
tiny fake encode / prefill / decode workers (FastAPI apps that follow the
worker protocol), each under uvicorn on a free 127.0.0.1 port."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from foveal.disagg.router import RouterConfig, _sse_events, build_router_app
from foveal.entrypoints.security_args import SecurityConfig
from tests.e2e.test_openai_server import LiveServer

IMAGE = "data:image/png;base64,iVBORw0KGgo="


class FakeWorker:
    """A worker of one role. behaviour: ok, fail (500), reject (400), hang
    (until released), drop (a decode stream that breaks after two events)."""

    def __init__(self, role: str, name: str, behaviour: str = "ok", chunk_delay_s: float = 0.01,
                 num_repeats: int = 1) -> None:
        self.role, self.name, self.behaviour = role, name, behaviour
        self.chunk_delay_s, self.num_repeats = chunk_delay_s, num_repeats
        self.bodies: list[dict] = []
        self.dead = self.released = False
        self.aborted = threading.Event()
        self.server = LiveServer(self._app())

    @property
    def url(self) -> str:
        return self.server.base_url

    def __enter__(self) -> FakeWorker:
        self.server.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.released = True
        self.server.__exit__(*exc)

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=503 if self.dead else 200)

        @app.get("/v1/models")
        async def models() -> dict:
            return {"object": "list", "data": [{"id": "fake-vlm", "owned_by": self.name}]}

        @app.post("/v1/chat/completions")
        @app.post("/v1/completions")
        async def complete(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            if self.behaviour == "fail":
                return JSONResponse({"error": {"message": "worker crashed"}}, status_code=500)
            if self.behaviour == "reject":
                return JSONResponse({"error": {"message": "max_tokens too large"}}, status_code=400)
            while self.behaviour == "hang" and not self.released:
                await asyncio.sleep(0.05)
            return self._answer(body)

        return app

    def _answer(self, body: dict) -> Response:
        if self.role == "encode":
            return JSONResponse({"ec_transfer_params": {"encoder": self.name}})
        if self.role == "prefill":
            return JSONResponse({"choices": [{"index": 0, "text": "x"}],
                                 "kv_transfer_params": {"prefill": self.name, "n": len(self.bodies)}})
        text = (f"{self.name} kv={json.dumps(body.get('kv_transfer_params'), sort_keys=True)} "
                f"ec={json.dumps(body.get('ec_transfer_params'), sort_keys=True)}")
        if body.get("stream"):
            return StreamingResponse(self._stream(text.split(" ") * self.num_repeats),
                                     media_type="text/event-stream")
        return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": text}}]})

    async def _stream(self, pieces: list[str]):
        finished = False
        try:
            for index, piece in enumerate(pieces):
                if self.behaviour == "drop" and index == 2:
                    self.dead = True
                    raise ConnectionError("fake decode worker died mid-stream")
                yield f"data: {json.dumps({'choices': [{'delta': {'content': piece}}]})}\n\n"
                await asyncio.sleep(self.chunk_delay_s)
            yield "data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:
                self.aborted.set()


@pytest.fixture(scope="module")
def workers():
    """Healthy fakes shared by the tests: e1, p1, p2, d1, d2 (their records are cleared per test)."""
    fakes = {name: FakeWorker(role, name) for role, name in
             (("encode", "e1"), ("prefill", "p1"), ("prefill", "p2"), ("decode", "d1"), ("decode", "d2"))}
    with contextlib.ExitStack() as stack:
        yield {name: stack.enter_context(fake) for name, fake in fakes.items()}


@pytest.fixture(autouse=True)
def clear_records(request):
    if "workers" in request.fixturenames:
        for fake in request.getfixturevalue("workers").values():
            fake.bodies.clear()


@contextlib.contextmanager
def router(encode=(), prefill=(), decode=(), **options):
    options = {"connect_timeout_s": 1.0, "stage_timeout_s": 5.0, "request_timeout_s": 10.0,
               "health_interval_s": 0.2, **options}
    config = RouterConfig(encode=tuple(w.url for w in encode), prefill=tuple(w.url for w in prefill),
                          decode=tuple(w.url for w in decode), **options)
    with LiveServer(build_router_app(config)) as server, \
            httpx.Client(base_url=server.base_url, timeout=10) as client:
        yield client


def chat_body(*, image: bool = False, stream: bool = False, **fields) -> dict:
    content = [{"type": "text", "text": "describe"}]
    if image:
        content.insert(0, {"type": "image_url", "image_url": {"url": IMAGE}})
    return {"model": "fake-vlm", "messages": [{"role": "user", "content": content}],
            "stream": stream, **fields}


def answer_text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def sse_payloads(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]


def test_encode_prefill_decode_forwards_the_transfer_params_exactly(workers):
    e1, p1, d1 = workers["e1"], workers["p1"], workers["d1"]
    body = chat_body(image=True, max_completion_tokens=20, temperature=0.5)
    with router([e1], [p1], [d1]) as client:
        text = answer_text(client.post("/v1/chat/completions", json=body))
    ec = {"encoder": "e1"}
    assert e1.bodies == [{**body, "stream": False}]
    prefill_body = {key: value for key, value in body.items() if key != "max_completion_tokens"}
    assert p1.bodies == [{**prefill_body, "max_tokens": 1, "stream": False, "ec_transfer_params": ec,
                          "kv_transfer_params": {"do_remote_decode": True}}]
    kv = {"prefill": "p1", "n": 1}
    # the decode worker needs the KV only: the embeddings went into it on the prefill worker
    assert d1.bodies == [{**body, "kv_transfer_params": kv}]
    assert text == f"d1 kv={json.dumps(kv, sort_keys=True)} ec=null"


def test_stream_events_arrive_in_order_and_end_with_done(workers):
    body = chat_body(image=True, stream=True, stream_options={"include_usage": True})
    with router([workers["e1"]], [workers["p1"]], [workers["d1"]]) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        text = "".join(response.iter_text())
    payloads = sse_payloads(text)
    assert payloads[-1] == "[DONE]"
    pieces = [json.loads(payload)["choices"][0]["delta"]["content"] for payload in payloads[:-1]]
    assert pieces == ['d1', 'kv={"n":', '1,', '"prefill":', '"p1"}', 'ec=null']
    assert "stream_options" not in workers["p1"].bodies[0]
    assert workers["d1"].bodies[0]["stream_options"] == {"include_usage": True}


def test_requests_without_media_skip_encode(workers):
    with router([workers["e1"]], [workers["p1"]], [workers["d1"]]) as client:
        answer_text(client.post("/v1/chat/completions", json=chat_body()))
        completion = client.post("/v1/completions", json={"model": "fake-vlm", "prompt": "hello"})
    assert completion.status_code == 200
    assert workers["e1"].bodies == [] and len(workers["p1"].bodies) == 2
    assert "ec_transfer_params" not in workers["d1"].bodies[1]


def test_without_prefill_pool_decode_serves_the_whole_request(workers):
    with router(decode=[workers["d1"]]) as client:
        assert answer_text(client.post("/v1/chat/completions", json=chat_body())) == "d1 kv=null ec=null"


def test_multi_turn_chat_sticks_to_one_prefill_worker(workers):
    turn1 = [{"role": "user", "content": "hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    turn3 = turn2 + [{"role": "assistant", "content": "sure"}, {"role": "user", "content": "and?"}]
    with router(prefill=[workers["p1"], workers["p2"]], decode=[workers["d1"]]) as client:
        for messages in (turn1, [{"role": "user", "content": "other"}], turn2, turn3):
            answer_text(client.post("/v1/chat/completions", json={"messages": messages}))
    first, second = workers["p1"], workers["p2"]
    assert [body["messages"] for body in first.bodies] == [turn1, turn2, turn3]
    assert len(second.bodies) == 1  # the unrelated conversation went to the idle worker


def test_workers_register_and_deregister_at_runtime(workers):
    d1 = workers["d1"]
    with router() as client:
        assert client.get("/health").status_code == 503
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 503
        registered = client.post("/router/workers", json={"role": "decode", "url": d1.url + "/"})
        assert registered.status_code == 200 and registered.json()["url"] == d1.url
        assert client.get("/health").status_code == 200
        answer_text(client.post("/v1/chat/completions", json=chat_body()))
        listing = client.get("/router/workers").json()
        assert listing == {"encode": [], "prefill": [], "decode": [
            {"url": d1.url, "healthy": True, "in_flight": 0, "served": 1, "failures": 0}]}
        assert client.get("/v1/models").json()["data"][0]["owned_by"] == "d1"
        assert client.request("DELETE", "/router/workers",
                              json={"role": "decode", "url": d1.url}).status_code == 200
        assert client.get("/router/workers").json()["decode"] == []
        assert client.request("DELETE", "/router/workers",
                              json={"role": "decode", "url": d1.url}).status_code == 404


def test_registering_an_unreachable_or_malformed_worker_is_a_400(workers):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{unused.getsockname()[1]}"
    with router() as client:
        refused = client.post("/router/workers", json={"role": "decode", "url": nobody})
        assert refused.status_code == 400 and "/health" in refused.json()["error"]["message"]
        assert client.post("/router/workers", json={"role": "vision", "url": nobody}).status_code == 400
        assert client.get("/router/workers").json()["decode"] == []


def test_worker_answering_500_is_retried_on_another(workers):
    with FakeWorker("prefill", "bad-p", "fail") as bad_prefill, \
            FakeWorker("decode", "bad-d", "fail") as bad_decode, \
            router(prefill=[bad_prefill, workers["p1"]], decode=[bad_decode, workers["d1"]],
                   health_interval_s=60) as client:
        for _ in range(2):
            assert answer_text(client.post("/v1/chat/completions", json=chat_body())).startswith("d1")
        listing = client.get("/router/workers").json()
        metrics = client.get("/metrics").text
    assert len(bad_prefill.bodies) == len(bad_decode.bodies) == 1  # out of rotation after failing
    assert [worker["failures"] for worker in listing["prefill"]] == [1, 0]
    assert [worker["failures"] for worker in listing["decode"]] == [1, 0]
    assert [worker["in_flight"] for worker in listing["prefill"] + listing["decode"]] == [0] * 4
    assert 'foveal:router_retries_total{pool="decode"} 1.0' in metrics
    assert 'foveal:router_failures_total{pool="prefill"} 1.0' in metrics


def test_worker_4xx_goes_back_to_the_client_without_retry(workers):
    with FakeWorker("decode", "picky", "reject") as picky, \
            router(decode=[picky, workers["d1"]]) as client:
        response = client.post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 400
    assert response.json() == {"error": {"message": "max_tokens too large"}}
    assert workers["d1"].bodies == []


def test_decode_dropping_mid_stream_ends_with_an_error_event_then_done(workers):
    with FakeWorker("decode", "fragile", "drop") as fragile, \
            router(decode=[fragile, workers["d2"]]) as client:
        with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as response:
            payloads = sse_payloads("".join(response.iter_text()))
        followup = client.post("/v1/chat/completions", json=chat_body())
        listing = client.get("/router/workers").json()["decode"]
    assert response.status_code == 200 and len(payloads) == 4 and payloads[-1] == "[DONE]"
    error = json.loads(payloads[2])["error"]
    assert error["type"] == "ServiceUnavailable" and error["code"] == 503
    assert fragile.url in error["message"] and "mid-stream" in error["message"]
    assert answer_text(followup).startswith("d2")
    assert len(fragile.bodies) == 1 and listing[0]["failures"] == 1 and not listing[0]["healthy"]


def test_hanging_prefill_worker_is_skipped_within_the_stage_timeout(workers):
    """A prefill pool that cannot answer in time is bypassed: decode workers serve
    whole requests, so the client still gets its answer, once the stage timed out."""
    with FakeWorker("prefill", "stuck", "hang") as stuck, \
            router(prefill=[stuck], decode=[workers["d1"]], stage_timeout_s=1.0) as client:
        started = time.monotonic()
        response = client.post("/v1/chat/completions", json=chat_body(), timeout=8)
        elapsed = time.monotonic() - started
        listing = client.get("/router/workers").json()["prefill"]
    assert response.status_code == 200 and answer_text(response) == "d1 kv=null ec=null"
    assert 1.0 <= elapsed < 5.0
    assert listing[0]["failures"] == 1  # out of rotation until its /health answers again


def test_hanging_decode_worker_gives_503_within_the_stage_timeout(workers):
    with FakeWorker("decode", "stuck", "hang") as stuck, \
            router(decode=[stuck], stage_timeout_s=1.0) as client:
        started = time.monotonic()
        response = client.post("/v1/chat/completions", json=chat_body(), timeout=8)
        elapsed = time.monotonic() - started
    assert response.status_code == 503 and elapsed < 5.0
    error = response.json()["error"]
    assert error["type"] == "ServiceUnavailable" and error["code"] == 503
    assert "no decode worker" in error["message"] and "timed out" in error["message"]


def test_empty_decode_pool_with_prefill_is_a_503(workers):
    with router(prefill=[workers["p1"]]) as client:
        response = client.post("/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 503 and "no decode worker" in response.json()["error"]["message"]
    assert workers["p1"].bodies == []


def test_client_disconnect_aborts_the_decode_stream(workers):
    with FakeWorker("decode", "slow", chunk_delay_s=0.05, num_repeats=100) as slow, \
            router(decode=[slow]) as client:
        with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        assert slow.aborted.wait(5)
        assert client.get("/router/workers").json()["decode"][0]["in_flight"] == 0


@pytest.mark.parametrize("field", ["kv_transfer_params", "ec_transfer_params"])
def test_client_injected_transfer_params_are_a_400(workers, field):
    with router(decode=[workers["d1"]]) as client:
        response = client.post("/v1/chat/completions", json=chat_body(**{field: {"remote": "x"}}))
    assert response.status_code == 400 and field in response.json()["error"]["message"]
    assert workers["d1"].bodies == []


def test_api_key_guards_completions_and_worker_admin_but_not_health(workers):
    keys = SecurityConfig(api_keys=("other", "secret"), max_concurrent_per_key=4)
    with router(decode=[workers["d1"]], security=keys) as client:
        assert client.get("/router/workers").status_code == 401
        assert client.post("/router/workers", json={"role": "decode", "url": workers["d2"].url}
                           ).status_code == 401
        assert client.post("/v1/chat/completions", json=chat_body()).status_code == 401
        assert client.get("/health").status_code == 200
        authorized = {"Authorization": "Bearer secret"}
        assert client.get("/router/workers", headers=authorized).status_code == 200
        answer_text(client.post("/v1/chat/completions", json=chat_body(), headers=authorized))
        assert client.get("/router/workers", headers={"Authorization": "Bearer other"}
                          ).status_code == 200
        assert client.get("/router/workers", headers={"Authorization": "Bearer secre"}
                          ).status_code == 401


def test_relay_forwards_only_whole_sse_events():
    buffer = bytearray()
    assert _sse_events(buffer, b'data: {"a": 1}\n\ndata: {"b"') == b'data: {"a": 1}\n\n'
    assert _sse_events(buffer, b': 2}\n\n') == b'data: {"b": 2}\n\n' and not buffer
    assert _sse_events(buffer, b"data: x\r\n\r\ndata: y") == b"data: x\r\n\r\n"


def test_worker_failing_health_checks_leaves_rotation_then_its_pool(workers):
    with FakeWorker("decode", "mortal") as mortal, \
            router(decode=[mortal, workers["d1"]], health_interval_s=0.1, remove_after_s=0.5) as client:
        mortal.dead = True
        deadline = time.monotonic() + 5
        while mortal.url in {w["url"] for w in client.get("/router/workers").json()["decode"]}:
            assert time.monotonic() < deadline, "the dead worker was never removed"
            time.sleep(0.05)
        assert answer_text(client.post("/v1/chat/completions", json=chat_body())).startswith("d1")
    assert mortal.bodies == []
