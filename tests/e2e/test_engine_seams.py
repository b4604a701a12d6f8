"""The engine seams on a real (tiny) model: an injected encoder connector
shared by two engines, and pixels that travel beside the plan, once per encode."""
from __future__ import annotations

import pytest
from PIL import Image

from foveal import SamplingParams
from foveal.engine.encoder_connector import EmbeddingStoreConnector
from foveal.engine_args import EngineArgs
from foveal.executor import build_engine_core
from foveal.llm_engine import LLMEngine
from foveal.worker.encoder_connector import EncoderConnectorWorker, InProcessEmbeddingStore

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe.<|im_end|>\n"
          "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def config(tiny_checkpoints):
    args = EngineArgs.from_kwargs(tiny_checkpoints("tiny-qwen2-vl"), max_model_len=512,
                                  kv_cache_memory_bytes=1 << 20)
    return args.create_engine_config()


def image(color: int) -> Image.Image:
    return Image.new("RGB", (56, 84), (color, 90, 200 - color))


def run(engine: LLMEngine, prompts: list[dict]) -> list[list[int]]:
    ids = [engine.new_request_id() for _ in prompts]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, GREEDY)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
    return [tokens[request_id] for request_id in ids]


def engine_with_store(config, store: InProcessEmbeddingStore) -> LLMEngine:
    core = build_engine_core(config, EmbeddingStoreConnector(store), EncoderConnectorWorker(store))
    return LLMEngine(config, core)


def test_engines_sharing_an_embedding_store_encode_each_image_once(config):
    store = InProcessEmbeddingStore()
    first, second = engine_with_store(config, store), engine_with_store(config, store)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": image(10)}}
    expected = run(LLMEngine(config), [prompt])
    assert run(first, [prompt]) == expected
    assert len(store) == 1 and first.get_metrics()["foveal:encoder_items_total"] == 1
    assert run(second, [prompt]) == expected
    assert second.get_metrics()["foveal:encoder_items_total"] == 0
    assert second.core.scheduler.encoder_connector.num_loads == 1
    other = {"prompt": PROMPT, "multi_modal_data": {"image": image(200)}}
    run(second, [other])
    assert second.get_metrics()["foveal:encoder_items_total"] == 1 and len(store) == 2


class RecordingExecutor:
    """Wraps the real executor and keeps what crosses to the workers each step."""

    def __init__(self, executor) -> None:
        self.executor = executor
        self.steps: list[tuple] = []

    def execute(self, plan, mm_payloads):
        self.steps.append((plan, mm_payloads))
        return self.executor.execute(plan, mm_payloads)

    def shutdown(self) -> None:
        self.executor.shutdown()


def test_pixels_travel_beside_the_plan_once_per_encode(config):
    engine = LLMEngine(config)
    recorder = engine.core.executor = RecordingExecutor(engine.core.executor)
    shared = image(60)
    prompts = [{"prompt": PROMPT, "multi_modal_data": {"image": shared}},
               {"prompt": PROMPT.replace("Describe", "Name it"),
                "multi_modal_data": {"image": shared}}]
    run(engine, prompts)
    features = [f for plan, _ in recorder.steps for new in plan.new_requests
                for f in new.mm_features]
    assert len(features) == 2
    assert all(not hasattr(value, "shape") for f in features for value in f.data.values())
    assert all("grid_thw" in f.data for f in features)
    shipped = [mm_hash for _, payloads in recorder.steps for mm_hash in payloads]
    assert shipped == [features[0].mm_hash]  # one image, sent once for two requests
    assert engine.get_metrics()["foveal:encoder_items_total"] == 1
