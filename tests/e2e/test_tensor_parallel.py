"""Tensor parallelism across processes (the `mp` executor, gloo on CPU; and
Ray actors): TP=2 gives the same greedy tokens as TP=1 for both
architectures, with images, video, chunked prefill, prefix-cache hits,
quantized KV and speculative decoding (int8 weights: near, by their
quantization error); a rank that dies or hangs fails the
engine with a clear error in bounded time and leaves no process behind; sizes
that cannot shard are ConfigErrors at start."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from PIL import Image

from foveal import LLM, SamplingParams
from foveal.errors import ConfigError, EngineDeadError
from tests.e2e.test_multimodal_caching import image, user

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
OPTIONS = dict(max_model_len=512, kv_cache_memory_bytes=1 << 21, max_num_batched_tokens=256)


def frames(count: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (56, 84, 3), dtype=np.uint8) for _ in range(count)]


def prompts(llm: LLM) -> list:
    """Images, a clip with an image, and text: the same list for every engine."""
    tokenizer = llm.get_tokenizer()
    video_messages = [{"role": "user", "content": [
        {"type": "image"}, {"type": "video"}, {"type": "text", "text": "what moves?"}]}]
    video_prompt = {"prompt": tokenizer.apply_chat_template(video_messages,
                                                            add_generation_prompt=True),
                    "multi_modal_data": {"image": Image.fromarray(frames(1, 7)[0]),
                                         "video": {"frames": frames(4, 3), "fps": 1}}}
    chats = [[user(f"describe picture {i}", image(40 * i))] for i in range(3)]
    chats.append([{"role": "user", "content": "say red green blue, red green blue"}])
    return [video_prompt] + chats


def run(llm: LLM) -> list[list[int]]:
    items = prompts(llm)
    video = llm.generate(items[:1], GREEDY, use_tqdm=False)
    chats = llm.chat(items[1:], GREEDY, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in video + chats]


@pytest.fixture(scope="module", params=["tiny-qwen2-vl", "tiny-qwen2.5-vl"])
def checkpoint(request, tiny_checkpoints) -> str:
    return tiny_checkpoints(request.param)


@pytest.mark.parametrize("options", [
    {},
    {"max_num_batched_tokens": 32, "kv_cache_dtype": "int8"},  # chunks through the media
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    {"mm_encoder_tp_mode": "data"},  # each rank encodes some of a step's items
], ids=["plain", "chunked-int8", "ngram", "encoder-data"])
def test_two_ranks_give_the_tokens_of_one(checkpoint, options):
    expected = run(LLM(model=checkpoint, **{**OPTIONS, **options}))  # TP=1
    llm = LLM(model=checkpoint, tensor_parallel_size=2, **{**OPTIONS, **options})
    try:
        assert llm.llm_engine.executor.kv_cache_spec.num_kv_heads == 1  # 2 KV heads, sharded
        assert run(llm) == expected
        assert run(llm) == expected  # again, from the prefix cache
        assert llm.get_metrics()["foveal:prefix_cache_hits_total"] > 0
    finally:
        llm.shutdown()


def test_two_ranks_with_int8_weights_agree_with_one_within_quantization_error(checkpoint,
                                                                            monkeypatch):
    """A row-parallel rank quantizes its half of each row (weights and the token's
    activations), so TP=2 int8 is near TP=1 int8, not bit-equal: compare the
    first token's distribution of every prompt. The exact per-token kernel on every
    CPU (FBGEMM's 7-bit activations would add their own error to the comparison)."""
    from foveal.layers.quantization import int8_kernel

    monkeypatch.setenv("FOVEAL_INT8_KERNEL", "exact")  # the ranks' processes read it too
    int8_kernel.cache_clear()
    first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)

    def distributions(llm: LLM) -> list[dict[int, float]]:
        items = prompts(llm)
        outputs = llm.generate(items[:1], first, use_tqdm=False) + llm.chat(
            items[1:], first, use_tqdm=False)
        return [{t: p.logprob for t, p in o.outputs[0].logprobs[0].items()} for o in outputs]

    options = {**OPTIONS, "quantization": "int8"}
    expected = distributions(LLM(model=checkpoint, **options))
    llm = LLM(model=checkpoint, tensor_parallel_size=2, **options)
    try:
        got = distributions(llm)
    finally:
        llm.shutdown()
    int8_kernel.cache_clear()
    for want, have in zip(expected, got, strict=True):
        top = max(want, key=want.get)
        # int8 vs float weights on these prompts: up to 0.16 apart
        assert top in have and abs(have[top] - want[top]) < 0.1, (want, have)


def test_eagle3_with_two_ranks_gives_the_tokens_of_one(tiny_checkpoints, tmp_path):
    """The head's layers and its KV shard like the target's (a random head: drafts
    are proposed and verified, whatever their acceptance)."""
    import json

    import torch

    from foveal.eagle_train.graph import Eagle3Graph, save_head
    from foveal.loader.eagle_config import load_eagle_config
    from foveal.loader.hf_config import model_config_from_hf

    checkpoint = tiny_checkpoints("tiny-qwen2-vl")
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512}))
    torch.manual_seed(0)
    save_head(Eagle3Graph(load_eagle_config("eagle3", str(tmp_path),
                                            model_config_from_hf(checkpoint).text)),
              tmp_path / "head")
    options = {**OPTIONS, "speculative_config": {
        "method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 3}}
    expected = run(LLM(model=checkpoint, **OPTIONS))
    llm = LLM(model=checkpoint, tensor_parallel_size=2, **options)
    try:
        assert run(llm) == expected
        assert llm.get_metrics()["foveal:spec_decode_num_draft_tokens_total"] > 0
    finally:
        llm.shutdown()


def worker_processes(llm: LLM) -> list:
    return list(llm.llm_engine.executor._processes)


def test_a_rank_that_dies_fails_the_engine_fast_and_leaves_nothing_behind(tiny_checkpoints):
    llm = LLM(model=tiny_checkpoints("tiny-qwen2-vl"), tensor_parallel_size=2, **OPTIONS)
    processes = worker_processes(llm)
    processes[1].kill()
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1|rank 0"):
        llm.chat([[user("hello", image(10))]], GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 30
    assert all(p.poll() is not None for p in processes)  # the other rank was stopped too
    with pytest.raises(EngineDeadError):
        llm.chat([[user("again", image(20))]], GREEDY, use_tqdm=False)


def test_a_rank_that_hangs_fails_the_engine_in_bounded_time(tiny_checkpoints, monkeypatch):
    monkeypatch.setenv("FOVEAL_WORKER_STEP_TIMEOUT_S", "5")
    monkeypatch.setenv("FOVEAL_COLLECTIVE_TIMEOUT_S", "5")
    llm = LLM(model=tiny_checkpoints("tiny-qwen2-vl"), tensor_parallel_size=2, **OPTIONS)
    processes = worker_processes(llm)
    os.kill(processes[1].pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        with pytest.raises(EngineDeadError, match="did not answer|failed on a tensor-parallel"):
            llm.chat([[user("hello", image(10))]], GREEDY, use_tqdm=False)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    assert time.monotonic() - started < 30
    assert all(p.poll() is not None for p in processes)


def test_shutdown_stops_every_rank(tiny_checkpoints):
    llm = LLM(model=tiny_checkpoints("tiny-qwen2-vl"), tensor_parallel_size=2, **OPTIONS)
    processes = worker_processes(llm)
    llm.shutdown()
    assert all(p.poll() == 0 for p in processes)


@pytest.mark.parametrize("size, message", [
    (3, "does not divide the model's attention heads"),
    (4, "needs 4 CPU cores"),
])
def test_sizes_that_cannot_shard_are_config_errors(tiny_checkpoints, monkeypatch, size, message):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # a 2-core machine
    with pytest.raises(ConfigError, match=message):
        LLM(model=tiny_checkpoints("tiny-qwen2-vl"), tensor_parallel_size=size, **OPTIONS)


def test_uni_executor_with_two_ranks_is_a_config_error(tiny_checkpoints):
    with pytest.raises(ConfigError, match="one worker process per rank"):
        LLM(model=tiny_checkpoints("tiny-qwen2-vl"), tensor_parallel_size=2,
            distributed_executor_backend="uni", **OPTIONS)


def tp_worker_pids(parent_pid: int) -> list[int]:
    """Processes running a tensor-parallel rank whose parent is `parent_pid`."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ")
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if b"foveal.executor.multiproc" in command and ppid == parent_pid:
            pids.append(int(entry))
    return pids


def test_the_server_answers_503_and_fails_health_when_a_rank_dies(tiny_checkpoints):
    """`foveal serve -tp 2`: the ranks run under the engine-core process."""
    import multiprocessing

    import httpx

    from tests.e2e.test_openai_server import MODEL_NAME, make_engine, serving

    checkpoint = tiny_checkpoints("tiny-qwen2-vl")
    before = set(multiprocessing.active_children())
    engine = make_engine(checkpoint, tensor_parallel_size=2)
    body = {"model": MODEL_NAME, "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello"}]}
    try:
        core = next(c for c in multiprocessing.active_children()
                    if c not in before and tp_worker_pids(c.pid))
        ranks = tp_worker_pids(core.pid)
        assert len(ranks) == 2
        with serving(engine, checkpoint) as server:
            url = server.base_url
            assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).status_code == 200
            os.kill(ranks[1], signal.SIGKILL)
            started = time.monotonic()
            response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert response.status_code == 503 and "rank" in response.json()["error"]["message"]
            assert time.monotonic() - started < 30
            assert httpx.get(f"{url}/health", timeout=10).status_code == 503
    finally:
        engine.shutdown()
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(running(pid) for pid in ranks)  # no orphan rank outlives the engine


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_ray_actors_give_the_tokens_of_local_processes_and_fail_cleanly(tiny_checkpoints):
    """A local Ray instance (what `ray start --head` gives on one host): the same
    tokens as the mp executor; a killed actor fails the engine in bounded time."""
    import ray

    checkpoint = tiny_checkpoints("tiny-qwen2.5-vl")
    llm = LLM(model=checkpoint, tensor_parallel_size=2, **OPTIONS)
    try:
        expected = run(llm)
    finally:
        llm.shutdown()
    llm = LLM(model=checkpoint, tensor_parallel_size=2, distributed_executor_backend="ray",
              **OPTIONS)
    try:
        assert llm.llm_engine.executor.kv_cache_spec.num_kv_heads == 1
        assert run(llm) == expected
        ray.kill(llm.llm_engine.executor._actors[1])
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match="died|failed"):
            llm.chat([[user("hello", image(10))]], GREEDY, use_tqdm=False)
        assert time.monotonic() - started < 30
    finally:
        llm.shutdown()
    assert not ray.is_initialized()  # the engine started Ray, and stopped it
