"""Disaggregated serving on Ray: worker servers as Ray actors of a local Ray
instance join a router (in this process) by themselves, answer as a worker
asked directly does, and leave the pool when removed or when their actor dies."""
from __future__ import annotations

import base64
import io
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from foveal.disagg.cluster_cli import RouterThread
from foveal.disagg.ray_cluster import ClusterWorker, RayCluster
from foveal.disagg.router import RouterConfig, build_router_app

SERVE_ARGS = ("--max-model-len", "1024", "--kv-cache-memory-bytes", str(8 << 20),
              "--preprocess-workers", "1")
CHAT = "/v1/chat/completions"


def chat_body() -> dict:
    pixels = np.random.default_rng(5).integers(0, 255, (56, 84, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    image = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": image}},
        {"type": "text", "text": "What is in the picture?"}]}],
        "temperature": 0.0, "max_tokens": 6, "ignore_eos": True}


def answer(url: str) -> dict:
    response = httpx.post(url + CHAT, json=chat_body(), timeout=60, trust_env=False)
    assert response.status_code == 200, response.text
    return response.json()


def text(body: dict) -> str:
    return body["choices"][0]["message"]["content"]


def pooled(router_url: str) -> dict[str, list[tuple[str, bool]]]:
    pools = httpx.get(router_url + "/router/workers", timeout=10, trust_env=False).json()
    return {role: [(worker["url"], worker["healthy"]) for worker in workers]
            for role, workers in pools.items()}


def serves(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def running_in_group(pgid: int) -> list[int]:
    """Pids of the process group that still run (zombies left for init are done)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def test_ray_actors_join_the_router_serve_and_leave(tiny_checkpoints):
    ray = pytest.importorskip("ray")
    checkpoint = tiny_checkpoints("tiny-qwen2-vl")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        app = build_router_app(RouterConfig(health_interval_s=0.5, stage_timeout_s=60))
        with RouterThread(app, "127.0.0.1", 0) as router, \
                RayCluster(checkpoint, router.url, serve_args=SERVE_ARGS) as cluster:
            prefill, decode = cluster.add_workers(["prefill", "decode"])
            assert pooled(router.url) == {"encode": [], "prefill": [(prefill, True)],
                                          "decode": [(decode, True)]}
            routed, direct = answer(router.url), answer(decode)  # direct: the whole request
            assert text(routed) == text(direct)
            assert routed["usage"]["completion_tokens"] == 6

            newcomer = cluster.add_worker("decode")
            assert cluster.remove_worker(decode) == decode
            assert not serves(decode)  # the server and its session are gone
            assert pooled(router.url)["decode"] == [(newcomer, True)]
            assert cluster.workers() == [ClusterWorker("prefill", prefill),
                                         ClusterWorker("decode", newcomer)]
            assert text(answer(router.url)) == text(routed)

            # an actor killed outright: its guard stops the server, which leaves the pool
            actor = cluster._members[prefill][1]
            server_pid = ray.get(actor.server_pid.remote(), timeout=10)
            assert running_in_group(server_pid)
            ray.kill(actor, no_restart=True)
            deadline = time.monotonic() + 30
            while running_in_group(server_pid):
                assert time.monotonic() < deadline, "the killed actor's server kept running"
                time.sleep(0.2)
            assert not serves(prefill)
            assert pooled(router.url)["prefill"] == []  # it left by itself, before any pruning
            assert cluster.prune_dead() == [ClusterWorker("prefill", prefill)]
        assert not serves(newcomer)  # shutdown stopped the rest
    finally:
        ray.shutdown()
