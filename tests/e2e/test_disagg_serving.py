"""Disaggregated serving end to end: one encode, one prefill and one decode
server behind `foveal router`, all real processes on 127.0.0.1, against one
mixed server on the same tiny checkpoint. Greedy answers must be equal (images,
two images, video, text, multi-turn with prefix hits, streaming, int8 KV); each
stage does only its own work; every pool gives its blocks back; a decode server
killed mid-stream gives a clean error and the pool recovers when a new decode
server joins."""
from __future__ import annotations

import base64
import io
import json
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.e2e.disagg_cluster import ServerProcess, metric, start_all
from tests.e2e.speech_clips import mute_clip

ENGINE_FLAGS = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(16 << 20),
                "--kv-cache-dtype", "int8", "--preprocess-workers", "1",
                "--limit-mm-per-prompt", "image=2,video=1"]
GREEDY = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def image_url(seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 255, (84, 112, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_part(seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": image_url(seed)}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


def user(*parts) -> dict:
    return {"role": "user", "content": list(parts)}


@pytest.fixture(scope="module")
def cluster(tiny_checkpoints, tmp_path_factory):
    checkpoint = tiny_checkpoints("tiny-qwen2-vl")
    logs = tmp_path_factory.mktemp("disagg-logs")
    servers = {role: ServerProcess(["serve", checkpoint, "--role", role, *ENGINE_FLAGS],
                                   logs / f"{role}.log")
               for role in ("mixed", "encode", "prefill", "decode")}
    start_all(list(servers.values()))
    router = ServerProcess(["router", "--encode", servers["encode"].url,
                            "--prefill", servers["prefill"].url,
                            "--decode", servers["decode"].url,
                            "--stage-timeout", "60", "--health-interval", "0.5"],
                           logs / "router.log")
    start_all([router])
    servers["router"] = router
    servers["checkpoint"] = checkpoint
    servers["logs"] = logs
    yield servers
    for server in servers.values():
        if isinstance(server, ServerProcess):
            server.stop()


def post(url: str, path: str, body: dict) -> dict:
    answer = httpx.post(url + path, json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()


def answer_text(body: dict) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def both(cluster, path: str, body: dict) -> tuple[dict, dict]:
    return post(cluster["mixed"].url, path, body), post(cluster["router"].url, path, body)


CONVERSATIONS = {
    "image": [user(image_part(1), text_part("What is in the picture?"))],
    "two images": [user(image_part(2), image_part(3), text_part("Which is brighter?"))],
    "video": [user({"type": "video_url", "video_url": {
        "url": "data:video/mp4;base64," + base64.b64encode(mute_clip(1.0)).decode()}},
        text_part("What moves?"))],
    "text": [user(text_part("Say something about the sea."))],
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_router_answers_equal_one_mixed_server(cluster, name):
    mixed, routed = both(cluster, CHAT, {"messages": CONVERSATIONS[name], **GREEDY})
    assert answer_text(routed) == answer_text(mixed)
    assert routed["usage"]["prompt_tokens"] == mixed["usage"]["prompt_tokens"]
    assert routed["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    assert "kv_transfer_params" not in routed  # the client sees a plain answer


def test_text_completions_and_streaming_through_the_router(cluster):
    body = {"prompt": "The weather today is", **GREEDY}
    mixed, routed = both(cluster, COMPLETIONS, body)
    assert answer_text(routed) == answer_text(mixed)
    chat = {"messages": CONVERSATIONS["image"], **GREEDY, "stream": True}
    pieces, events = [], []
    with httpx.stream("POST", cluster["router"].url + CHAT, json=chat, timeout=120) as stream:
        assert stream.status_code == 200
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        delta = json.loads(event[6:])["choices"]
        if delta:
            pieces.append(delta[0]["delta"].get("content", ""))
    expected = post(cluster["mixed"].url, CHAT, {**chat, "stream": False})
    assert "".join(pieces) == answer_text(expected)


def test_multi_turn_hits_the_prefill_cache_and_encodes_each_image_once(cluster):
    encode, prefill, decode = (cluster[role].url for role in ("encode", "prefill", "decode"))
    turn1 = [user(image_part(7), text_part("Describe it."))]
    first = both(cluster, CHAT, {"messages": turn1, **GREEDY})
    assert answer_text(first[1]) == answer_text(first[0])
    encoded = metric(encode, "foveal:encoder_items_total")
    hits = metric(prefill, "foveal:prefix_cache_hits_total")
    turn2 = turn1 + [{"role": "assistant", "content": answer_text(first[1])},
                     user(text_part("And the colours?"))]
    second = both(cluster, CHAT, {"messages": turn2, **GREEDY})
    assert answer_text(second[1]) == answer_text(second[0])
    assert metric(prefill, "foveal:prefix_cache_hits_total") > hits  # turn 1's KV reused
    assert metric(encode, "foveal:encoder_items_total") == encoded  # the image's embeddings too
    # each stage did only its part: the tower ran on the encode server alone
    assert metric(prefill, "foveal:encoder_items_total") == 0
    assert metric(decode, "foveal:encoder_items_total") == 0
    assert metric(decode, "foveal:kv_imported_tokens_total") > 0
    assert metric(decode, "foveal:transfer_bytes_total") > 0
    assert metric(prefill, "foveal:transfer_bytes_total") > 0  # embeddings pulled
    assert metric(decode, "foveal:transfer_failures_total") == 0
    # a third turn adds an image: only the new one runs through the tower
    turn3 = turn2 + [{"role": "assistant", "content": answer_text(second[1])},
                     user(image_part(8), text_part("Compare both."))]
    third = both(cluster, CHAT, {"messages": turn3, **GREEDY})
    assert answer_text(third[1]) == answer_text(third[0])
    assert metric(encode, "foveal:encoder_items_total") == encoded + 1


def test_every_worker_gives_its_blocks_back(cluster):
    for role in ("mixed", "prefill", "decode"):
        assert metric(cluster[role].url, "foveal:kv_cache_usage_perc") == 0.0, role
        assert metric(cluster[role].url, "foveal:num_requests_running") == 0.0, role


def test_a_bad_transfer_is_refused_and_recomputed(cluster):
    decode = cluster["decode"].url
    prefilled = post(cluster["prefill"].url, CHAT, {
        "messages": CONVERSATIONS["image"], **GREEDY, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True}})
    params = prefilled["kv_transfer_params"]
    assert params["num_tokens"] > 0 and params["transfer_id"]
    failures = metric(decode, "foveal:transfer_failures_total")
    forged = {**params, "digest": "0" * 64}  # another prompt's KV: refused, computed here
    answer = post(decode, CHAT, {"messages": CONVERSATIONS["image"], **GREEDY,
                                 "kv_transfer_params": forged})
    expected = post(cluster["mixed"].url, CHAT, {"messages": CONVERSATIONS["image"], **GREEDY})
    assert answer_text(answer) == answer_text(expected)
    assert metric(decode, "foveal:transfer_failures_total") == failures + 1
    malformed = httpx.post(decode + CHAT, json={"messages": CONVERSATIONS["text"], **GREEDY,
                                                "kv_transfer_params": {"transfer_id": 3}},
                           timeout=60)
    assert malformed.status_code == 400, malformed.text
    streamed = httpx.post(cluster["prefill"].url + CHAT, timeout=60, json={
        "messages": CONVERSATIONS["text"], **GREEDY, "stream": True,
        "kv_transfer_params": {"do_remote_decode": True}})
    assert streamed.status_code == 400 and "stream=false" in streamed.text


def test_decode_server_killed_mid_stream_then_a_new_one_joins(cluster):
    router = cluster["router"].url
    body = {"messages": CONVERSATIONS["text"], "temperature": 0.0, "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream("POST", router + CHAT, json=body, timeout=120) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line)
            if len(events) == 3:
                cluster["decode"].kill()
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == 503 and "decode" in error["message"]
    refused = httpx.post(router + CHAT, json={"messages": CONVERSATIONS["text"], **GREEDY},
                         timeout=60)
    assert refused.status_code == 503, refused.text
    newcomer = ServerProcess(["serve", cluster["checkpoint"], "--role", "decode", *ENGINE_FLAGS,
                              "--router", router], cluster["logs"] / "decode2.log")
    cluster["decode2"] = newcomer
    start_all([newcomer])
    deadline = time.monotonic() + 60
    while httpx.get(router + "/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, "the new decode server never joined"
        time.sleep(0.5)
    mixed, routed = both(cluster, CHAT, {"messages": CONVERSATIONS["image"], **GREEDY})
    assert answer_text(routed) == answer_text(mixed)
    assert metric(cluster["prefill"].url, "foveal:kv_cache_usage_perc") == 0.0
