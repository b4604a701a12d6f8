"""A client that goes away cancels its request, streamed or not: the engine aborts it
(its KV blocks and encoder references freed) and a PDF job still queued for it
leaves the stage's queue."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from test_openai_server import (MODEL_NAME, LiveServer, data_url, engine_stats, image_message,
                                make_engine, png_bytes)

from starlette.responses import Response

from foveal.entrypoints.openai.api_server import build_app
from foveal.entrypoints.openai.errors import APIError
from foveal.entrypoints.openai.serving_engine import ServerConfig, unless_disconnected
from foveal.stages.config import StagesConfig
from foveal.stages.service import StagePools
from tests.stages.stage_documents import make_text_pdf

ABORTED = 'foveal:request_success_total{finished_reason="abort"}'
LONG = {"temperature": 0.0, "max_tokens": 900, "ignore_eos": True}


def wait_until(condition, timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s} s"
        time.sleep(0.05)


def send_request(base_url: str, path: str, body: dict) -> socket.socket:
    """A raw POST whose answer nobody reads; closing the socket is the disconnect."""
    address = urlsplit(base_url)
    payload = json.dumps(body).encode()
    sock = socket.create_connection((address.hostname, address.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {address.netloc}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
                 .encode() + payload)
    return sock


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def pools():
    with StagePools(StagesConfig(workers={"pdf": 1}, queue_size=4)) as stage_pools:
        yield stage_pools


@pytest.fixture(scope="module")
def server(checkpoint, pools):
    engine = make_engine(checkpoint)
    config = ServerConfig(served_model_names=(MODEL_NAME,), model_path=checkpoint)
    try:
        with LiveServer(build_app(engine, config, stage_pools=pools)) as live:
            yield live
    finally:
        engine.shutdown()


async def _never_disconnects() -> dict:
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


def test_a_disconnect_cancels_the_work_and_answers_499_to_nobody():
    async def scenario() -> tuple[int, bool]:
        gone, cleaned_up = asyncio.Event(), asyncio.Event()

        async def receive() -> dict:
            await gone.wait()
            return {"type": "http.disconnect"}

        async def work() -> Response:
            try:
                await asyncio.Event().wait()
            finally:
                cleaned_up.set()

        pending = asyncio.create_task(unless_disconnected(work(), receive))
        await asyncio.sleep(0.01)
        gone.set()
        return (await asyncio.wait_for(pending, 10)).status_code, cleaned_up.is_set()

    assert asyncio.run(scenario()) == (499, True)


def test_without_a_disconnect_the_work_answers_or_raises():
    async def answer() -> Response:
        return Response(b"done")

    async def fail() -> Response:
        raise APIError("model 'x' is not served here")

    assert asyncio.run(unless_disconnected(answer(), _never_disconnects)).body == b"done"
    with pytest.raises(APIError, match="not served here"):
        asyncio.run(unless_disconnected(fail(), _never_disconnects))


def _idle(base_url: str) -> bool:
    stats = engine_stats(base_url)
    return stats["foveal:num_requests_running"] == 0 and stats["foveal:kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("path,stream", [("/v1/chat/completions", False),
                                         ("/v1/chat/completions", True),
                                         ("/v1/completions", False)])
def test_client_disconnect_aborts_the_request_and_frees_its_blocks(server, path, stream):
    if path == "/v1/completions":
        body = {"model": MODEL_NAME, "prompt": "Count to a thousand:", "stream": stream, **LONG}
    else:
        body = {"model": MODEL_NAME, "messages": image_message(data_url(png_bytes())),
                "stream": stream, **LONG}
    aborted_before = engine_stats(server.base_url).get(ABORTED, 0)
    sock = send_request(server.base_url, path, body)
    try:
        wait_until(lambda: engine_stats(server.base_url)["foveal:kv_cache_usage_perc"] > 0,
                   what="the request running")
    finally:
        sock.close()
    wait_until(lambda: _idle(server.base_url), what="no request running, no KV in use")
    assert engine_stats(server.base_url)[ABORTED] == aborted_before + 1


def pdf_body(word: str) -> dict:
    pdf = base64.b64encode(make_text_pdf([[f"The secret word is {word}."]])).decode()
    part = {"type": "file", "file": {"file_data": f"data:application/pdf;base64,{pdf}",
                                     "filename": f"{word}.pdf"}}
    question = {"type": "text", "text": "What is the secret word?"}
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": [part, question]}],
            "temperature": 0.0, "max_tokens": 4}


def test_client_disconnect_takes_its_queued_pdf_job_out_of_the_stage_queue(server, pools):
    """The one PDF worker is stopped with the first job on it, so the second job waits in
    the queue; its client leaves, and the queue empties while the worker is still stopped."""
    pools.warm_up("pdf")
    backend = pools.backend("pdf")
    [worker_pid] = backend.worker_pids()
    misses = 'foveal:stage_cache_misses_total{stage="pdf"}'
    cancelled = 'foveal:stage_cancelled_total{stage="pdf"}'
    before = pools.get_metrics()
    os.kill(worker_pid, signal.SIGSTOP)
    try:
        on_worker = send_request(server.base_url, "/v1/chat/completions", pdf_body("alpha"))
        wait_until(lambda: pools.get_metrics()[misses] == before[misses] + 1
                   and backend.queue_depth() == 0, what="the first job on the worker")
        queued = send_request(server.base_url, "/v1/chat/completions", pdf_body("beta"))
        wait_until(lambda: backend.queue_depth() == 1, what="the second job queued")
        queued.close()
        wait_until(lambda: backend.queue_depth() == 0, what="the queue emptied")
        assert pools.get_metrics()[cancelled] == before[cancelled] + 1
        on_worker.close()
    finally:
        os.kill(worker_pid, signal.SIGCONT)
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        response = http.post("/v1/chat/completions", json=pdf_body("beta"))
    assert response.status_code == 200, response.text
    assert backend.worker_pids() == [worker_pid]
    wait_until(lambda: _idle(server.base_url), what="no request running, no KV in use")
