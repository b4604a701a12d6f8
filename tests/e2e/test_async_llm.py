"""AsyncLLM end to end: engine core in its own process, preprocessing in a
pool, detokenization in the API process; checked against the offline LLM."""
from __future__ import annotations

import asyncio
import io
import multiprocessing

import numpy as np
import pytest
from PIL import Image

from foveal import LLM, SamplingParams
from foveal.async_engine import AsyncLLM
from foveal.engine_args import EngineArgs
from foveal.errors import (ContextLengthError, EngineDeadError, EngineOverloadedError,
                           InvalidRequestError, MediaError)

MAX_PENDING = 8
ENGINE_KWARGS = dict(max_model_len=1024, kv_cache_memory_bytes=32 << 20,
                     encoder_compute_budget=200)  # a 448x448 image (256 tokens) fails admission
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
RUNNING = "foveal:num_requests_running"
KV_USAGE = "foveal:kv_cache_usage_perc"
ABORTED = 'foveal:request_success_total{finished_reason="abort"}'
STOPPED = 'foveal:request_success_total{finished_reason="stop"}'


def _image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _prompt(text: str, images: list | None = None) -> dict:
    vision = "<|vision_start|><|image_pad|><|vision_end|>" * len(images or [])
    prompt = {"prompt": f"<|im_start|>user\n{vision}{text}<|im_end|>\n<|im_start|>assistant\n"}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    return prompt


def _engine_args(path: str) -> EngineArgs:
    return EngineArgs.from_kwargs(path, **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints) -> str:
    return tiny_checkpoints("tiny-qwen2-vl")


@pytest.fixture(scope="module")
def offline_llm(checkpoint):
    llm = LLM(model=checkpoint, **ENGINE_KWARGS)
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def async_llm(checkpoint):
    llm = AsyncLLM(_engine_args(checkpoint), preprocess_workers=1,
                   max_pending_requests=MAX_PENDING)
    yield llm
    llm.shutdown()


async def _collect(llm: AsyncLLM, prompt, params, request_id: str, stream: bool = True):
    return [output async for output in llm.generate(prompt, params, request_id, stream=stream)]


async def _wait_until_idle(llm: AsyncLLM) -> dict[str, float]:
    """Aborts travel to the core asynchronously; wait (bounded) for it to drain."""
    for _ in range(500):
        metrics = await llm.get_metrics()
        if metrics[RUNNING] == 0 and metrics["foveal:num_requests_waiting"] == 0:
            return metrics
        await asyncio.sleep(0.02)
    raise AssertionError(f"the engine core never became idle: {metrics}")


def _our_children() -> set[int]:
    return {child.pid for child in multiprocessing.active_children()}


@pytest.mark.parametrize("images", [[], [_image(224, 168, 1)]], ids=["text", "image"])
def test_streamed_deltas_join_to_non_streamed_and_offline_output(async_llm, offline_llm, images):
    prompt = _prompt("Describe this in detail.", images)
    expected = offline_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]

    async def run():
        deltas = await _collect(async_llm, prompt, GREEDY, "stream")
        final = await _collect(async_llm, prompt, GREEDY, "whole", stream=False)
        return deltas, final

    deltas, final = asyncio.run(run())
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].outputs[0].finish_reason == expected.finish_reason
    assert "".join(d.outputs[0].text for d in deltas) == expected.text
    assert sum((d.outputs[0].token_ids for d in deltas), []) == expected.token_ids
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].text == expected.text
    assert final[0].outputs[0].token_ids == expected.token_ids
    assert final[0].metrics.preprocess_time > 0


def test_eight_concurrent_image_requests_all_complete_correctly(async_llm, offline_llm):
    prompts = [_prompt(f"Question {i}: what is shown?", [_image(112 + 28 * i, 84, i)])
               for i in range(MAX_PENDING)]
    expected = [out.outputs[0].text for out in offline_llm.generate(prompts, GREEDY,
                                                                    use_tqdm=False)]

    async def run():
        return await asyncio.gather(*(_collect(async_llm, prompt, GREEDY, f"c{i}", stream=False)
                                      for i, prompt in enumerate(prompts)))

    results = asyncio.run(run())
    assert [outputs[-1].outputs[0].text for outputs in results] == expected
    assert all(outputs[-1].outputs[0].finish_reason == "length" for outputs in results)


@pytest.mark.parametrize("prompt, error_type, match", [
    (_prompt("What is this?", [b"\x89PNG\r\n\x1a\n not really a png"]), MediaError, None),
    (_prompt("word " * 1100), ContextLengthError, "max_model_len"),
    (_prompt("Too big?", [_image(448, 448, 9)]), InvalidRequestError, "encoder-compute-budget"),
], ids=["corrupt-image", "too-long-prompt", "rejected-by-core-admission"])
def test_invalid_request_raises_typed_error_and_next_request_works(async_llm, prompt,
                                                                   error_type, match):
    async def run():
        generator = async_llm.generate(prompt, GREEDY, "bad")
        with pytest.raises(error_type, match=match):
            await generator.__anext__()
        return await _collect(async_llm, _prompt("Hello"), GREEDY, "good", stream=False)

    outputs = asyncio.run(run())
    assert outputs[-1].finished and outputs[-1].outputs[0].token_ids


def test_breaking_out_of_stream_aborts_request_and_frees_its_blocks(async_llm):
    async def run():
        before = await async_llm.get_metrics()
        num_deltas = 0
        async for _ in async_llm.generate(_prompt("Go", [_image(224, 168, 3)]), LONG, "brk"):
            num_deltas += 1
            if num_deltas == 3:
                break
        return before, await _wait_until_idle(async_llm)

    before, after = asyncio.run(run())
    assert after[KV_USAGE] == 0
    assert after[ABORTED] == before[ABORTED] + 1


def test_abort_ends_stream_with_finish_reason_abort(async_llm):
    async def run():
        outputs = []
        async for output in async_llm.generate(_prompt("Go on"), LONG, "to-abort"):
            outputs.append(output)
            if len(outputs) == 2:
                await async_llm.abort("to-abort")
        return outputs, await _wait_until_idle(async_llm)

    outputs, metrics = asyncio.run(run())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert metrics[KV_USAGE] == 0


def test_stop_string_finishes_request_and_stops_it_in_core(async_llm, offline_llm):
    prompt = _prompt("Say something long.")
    full_text = offline_llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = full_text[len(full_text) // 2:len(full_text) // 2 + 3]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop=[stop])

    async def run():
        before = await async_llm.get_metrics()
        deltas = await _collect(async_llm, prompt, params, "stopper")
        return before, deltas, await _wait_until_idle(async_llm)

    before, deltas, after = asyncio.run(run())
    assert "".join(d.outputs[0].text for d in deltas) == full_text[:full_text.find(stop)]
    assert deltas[-1].outputs[0].finish_reason == "stop"
    assert deltas[-1].outputs[0].stop_reason == stop
    assert after[STOPPED] == before[STOPPED] + 1


def test_more_than_max_pending_requests_raises_engine_overloaded(async_llm):
    async def hold(request_id: str, started: asyncio.Event):
        async for _ in async_llm.generate(_prompt("Keep going"), LONG, request_id):
            started.set()

    async def run():
        events = [asyncio.Event() for _ in range(MAX_PENDING)]
        tasks = [asyncio.create_task(hold(f"hold{i}", event)) for i, event in enumerate(events)]
        await asyncio.gather(*(event.wait() for event in events))
        with pytest.raises(EngineOverloadedError, match="max_pending_requests"):
            await async_llm.generate(_prompt("One more"), GREEDY, "extra").__anext__()
        for task in tasks:
            task.cancel()  # cancelled consumers abort their requests
        await asyncio.gather(*tasks, return_exceptions=True)
        return await _wait_until_idle(async_llm)

    assert asyncio.run(run())[KV_USAGE] == 0


def test_duplicate_in_flight_request_id_raises_and_id_is_free_again_after(async_llm):
    async def run():
        first = async_llm.generate(_prompt("Hi"), LONG, "same-id")
        await first.__anext__()
        with pytest.raises(InvalidRequestError, match="already in flight"):
            await async_llm.generate(_prompt("Hi"), GREEDY, "same-id").__anext__()
        await first.aclose()
        return await _collect(async_llm, _prompt("Hi"), GREEDY, "same-id", stream=False)

    outputs = asyncio.run(run())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"


def test_core_process_death_fails_pending_requests_and_health(checkpoint):
    children_before = _our_children()
    llm = AsyncLLM(_engine_args(checkpoint), preprocess_workers=0)
    core_pids = _our_children() - children_before
    assert len(core_pids) == 1  # preprocess_workers=0: only the engine core process

    async def run():
        assert await llm.check_health()
        generator = llm.generate(_prompt("Go"), LONG, "doomed")
        await generator.__anext__()
        next(c for c in multiprocessing.active_children() if c.pid in core_pids).kill()
        with pytest.raises(EngineDeadError):
            async for _ in generator:
                pass
        assert not await llm.check_health()
        with pytest.raises(EngineDeadError):
            await llm.generate(_prompt("Hi"), GREEDY, "after").__anext__()

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()


def test_shutdown_leaves_no_child_process(checkpoint):
    children_before = _our_children()

    async def run():
        async with AsyncLLM(_engine_args(checkpoint), preprocess_workers=2) as llm:
            assert _our_children() - children_before
            outputs = await _collect(llm, _prompt("Hi", [_image(56, 56, 5)]), GREEDY, "one")
            assert outputs[-1].finished
        llm.shutdown()  # idempotent
        assert not await llm.check_health()

    asyncio.run(run())
    assert _our_children() <= children_before
