"""Faults the server reports and outlives: an engine core killed (SIGKILL) or hung
(SIGSTOP) fails the requests it held with 503 and fails /health; then a new core
serves (restart) or `foveal serve` exits 1 with no process left behind (exit). A
killed PDF stage worker is replaced."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_openai_server import ENGINE_OPTIONS, MODEL_NAME, LiveServer, engine_stats
from test_server_disconnect import pdf_body, wait_until

from foveal.entrypoints.openai.api_server import build_app
from foveal.entrypoints.openai.serving_engine import ServerConfig
from foveal.stages.pool import WorkerProcess
from foveal.stages.service import StagePools

HANG_TIMEOUT_S = 3.0
CHAT = "/v1/chat/completions"
LONG = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Count to a thousand."}],
        "temperature": 0.0, "max_tokens": 900, "ignore_eos": True}
SHORT = {**LONG, "max_tokens": 12}


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def num_running(base_url: str) -> float:
    return engine_stats(base_url)["foveal:num_requests_running"]  # KeyError if not exported


def healthy(base_url: str) -> bool:
    return httpx.get(f"{base_url}/health", timeout=10).status_code == 200


def read_stream(base_url: str, body: dict) -> tuple[int, str]:
    with httpx.stream("POST", base_url + CHAT, json={**body, "stream": True},
                      timeout=60) as response:
        return response.status_code, response.read().decode()


def in_flight(base_url: str, executor: ThreadPoolExecutor, streams: int = 0) -> list:
    """One whole and `streams` streamed long requests, running in the engine on return."""
    futures = [executor.submit(httpx.post, base_url + CHAT, json=LONG, timeout=60)]
    futures += [executor.submit(read_stream, base_url, LONG) for _ in range(streams)]
    wait_until(lambda: num_running(base_url) == 1 + streams, what="the requests running")
    return futures


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def pools():
    with StagePools({"pdf": 1}) as stage_pools:
        yield stage_pools


def async_engine(checkpoint: str, restart_failed_core: bool):
    from foveal.async_engine import AsyncLLM
    from foveal.engine_args import EngineArgs

    return AsyncLLM(EngineArgs.from_kwargs(checkpoint, **ENGINE_OPTIONS), preprocess_workers=1,
                    restart_failed_core=restart_failed_core, core_hang_timeout_s=HANG_TIMEOUT_S)


def server_config(checkpoint: str) -> ServerConfig:
    return ServerConfig(served_model_names=(MODEL_NAME,), model_path=checkpoint)


@pytest.fixture(scope="module")
def restarting(checkpoint, pools):
    """(engine, live server): an engine that starts a new core when its core fails."""
    engine = async_engine(checkpoint, restart_failed_core=True)
    try:
        with LiveServer(build_app(engine, server_config(checkpoint), stage_pools=pools)) as live:
            yield engine, live
    finally:
        engine.shutdown()


def test_killed_core_fails_its_requests_with_503_then_a_new_core_serves(restarting):
    engine, live = restarting
    failed_pid, num_restarts = engine.core_pid, engine.num_core_restarts
    with ThreadPoolExecutor(2) as executor:
        whole, streamed = in_flight(live.base_url, executor, streams=1)
        os.kill(failed_pid, signal.SIGKILL)
        response = whole.result(timeout=60)
        status, events = streamed.result(timeout=60)
    assert response.status_code == 503
    assert "engine core process exited" in response.json()["error"]["message"]
    assert status == 200 and '"code":503' in events and events.endswith("data: [DONE]\n\n")
    wait_until(lambda: healthy(live.base_url), timeout_s=120, what="/health 200 again")
    assert engine.core_pid != failed_pid and not running(failed_pid)
    assert engine.num_core_restarts == num_restarts + 1
    response = httpx.post(live.base_url + CHAT, json=SHORT, timeout=60)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 12


def test_hung_core_is_killed_within_the_hang_timeout_and_without_restart_all_fail(checkpoint):
    engine = async_engine(checkpoint, restart_failed_core=False)
    failures = []
    engine.when_failed(failures.append)
    hung_pid = engine.core_pid
    try:
        with LiveServer(build_app(engine, server_config(checkpoint))) as live, \
                ThreadPoolExecutor(1) as executor:
            [whole] = in_flight(live.base_url, executor)
            os.kill(hung_pid, signal.SIGSTOP)
            response = whole.result(timeout=30)
            health = httpx.get(live.base_url + "/health", timeout=10)
            later = httpx.post(live.base_url + CHAT, json=SHORT, timeout=60)
    finally:
        if running(hung_pid):
            os.kill(hung_pid, signal.SIGCONT)
        engine.shutdown()
    assert response.status_code == 503
    assert "answered nothing" in response.json()["error"]["message"]
    assert not running(hung_pid) and len(failures) == 1
    assert health.status_code == 503
    assert later.status_code == 503 and "answered nothing" in later.json()["error"]["message"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_exits_1_when_its_core_is_killed_and_leaves_no_process_behind(checkpoint):
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "foveal.entrypoints.cli", "serve", checkpoint, "--port", str(port),
         "--served-model-name", MODEL_NAME, "--preprocess-workers", "1", "--max-model-len", "1024",
         "--kv-cache-memory-bytes", str(8 << 20), "--on-engine-failure", "exit",
         "--engine-hang-timeout", str(HANG_TIMEOUT_S)],
        stderr=subprocess.PIPE, text=True)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(server.stderr), daemon=True)
    reader.start()
    def core_pids() -> list[int]:
        return [int(pid) for pid in re.findall(r"engine core process (\d+) is ready", "".join(log))]

    try:
        wait_until(lambda: server.poll() is not None or (core_pids() and _answers(base_url)),
                   timeout_s=180, what="the server up")
        assert server.poll() is None, "".join(log)
        children = descendants(server.pid)
        [core_pid] = core_pids()
        assert core_pid in children
        with ThreadPoolExecutor(1) as executor:
            [whole] = in_flight(base_url, executor)
            os.kill(core_pid, signal.SIGKILL)
            response = whole.result(timeout=30)
        assert server.wait(timeout=60) == 1
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    reader.join(timeout=10)
    assert response.status_code == 503, response.text
    assert "the engine core process exited" in "".join(log)
    wait_until(lambda: not any(running(pid) for pid in children), timeout_s=10,
               what=f"none of the server's processes {sorted(children)} running")


def _answers(base_url: str) -> bool:
    try:
        return healthy(base_url)
    except httpx.TransportError:
        return False


def test_killed_pdf_worker_is_replaced_and_its_job_retried(restarting, pools):
    _, live = restarting
    pools.warm_up("pdf")
    backend = pools.backend("pdf")
    [worker_pid] = backend.worker_pids()
    restarts = 'foveal:stage_worker_restarts_total{stage="pdf"}'
    misses = 'foveal:stage_cache_misses_total{stage="pdf"}'
    before = pools.get_metrics()
    os.kill(worker_pid, signal.SIGSTOP)  # so the job is surely on it when it is killed
    with ThreadPoolExecutor(1) as executor:
        answer = executor.submit(httpx.post, live.base_url + CHAT, json=pdf_body("gamma"),
                                 timeout=60)
        wait_until(lambda: pools.get_metrics()[misses] == before[misses] + 1
                   and backend.queue_depth() == 0, what="the job on the worker")
        os.kill(worker_pid, signal.SIGKILL)
        response = answer.result(timeout=60)
    assert response.status_code == 200, response.text
    assert backend.worker_pids() != [worker_pid] and len(backend.worker_pids()) == 1
    assert pools.get_metrics()[restarts] == before[restarts] + 1


def test_pdf_worker_killed_on_every_attempt_is_a_502_then_the_pool_serves(restarting, pools,
                                                                         monkeypatch):
    _, live = restarting
    start = WorkerProcess._start

    def start_then_die(worker) -> None:
        start(worker)
        os.kill(worker.pid, signal.SIGKILL)

    for pid in pools.backend("pdf").worker_pids():
        os.kill(pid, signal.SIGKILL)
    monkeypatch.setattr(WorkerProcess, "_start", start_then_die)
    response = httpx.post(live.base_url + CHAT, json=pdf_body("delta"), timeout=60)
    monkeypatch.undo()
    assert response.status_code == 502
    assert "pdf worker died twice" in response.json()["error"]["message"]
    again = httpx.post(live.base_url + CHAT, json=pdf_body("delta"), timeout=60)
    assert again.status_code == 200, again.text
