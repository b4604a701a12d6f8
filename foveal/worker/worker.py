"""One rank's worker: its device, its share of the model, its KV pool and model runner.

An executor owns one worker per rank and drives them all the same way:
load_model, determine_num_blocks (each rank measures its own memory; the
executor takes the minimum), initialize_cache, then execute once per step with
the same StepPlan on every rank.
"""
from __future__ import annotations

from typing import Any

import torch

from foveal.config import EngineConfig
from foveal.distributed import get_tp_size
from foveal.engine.plan import ModelRunnerOutput, StepPlan
from foveal.errors import EngineDeadError
from foveal.layers.attention.kv_spec import KVCacheSpec
from foveal.layers.linear import prepack_weights
from foveal.layers.quantization import quantize_weights
from foveal.multimodal.inputs import MMFeature
from foveal.worker.compiled_decode import compile_applies
from foveal.worker.device import torch_dtype
from foveal.worker.encoder_runner import EncoderCache
from foveal.worker.kv_cache import available_kv_memory, kv_cache_spec
from foveal.worker.kv_offload import KVOffloadWorker
from foveal.worker.model_runner import ModelRunner
from foveal.worker.spec_decode.eagle import draft_cache_block_bytes


class Worker:
    def __init__(self, engine_config: EngineConfig, rank: int = 0,
                 encoder_connector: Any = None) -> None:
        """encoder_connector: the worker half of an encoder connector
        (foveal/worker/encoder_connector.py), or None."""
        self.config = engine_config
        self.rank = rank
        self.encoder_connector = encoder_connector
        device = torch.device(engine_config.device)
        if device.type == "cuda" and device.index is not None:
            # Triton kernels and CUDA graphs run on the current device: make it this one
            torch.cuda.set_device(device)
        self.model = None
        self.draft_head = None
        self.model_runner: ModelRunner | None = None
        self.kv_cache_spec: KVCacheSpec = kv_cache_spec(
            engine_config.model, engine_config.cache, engine_config.dtype, get_tp_size())

    def load_model(self) -> None:
        from foveal.loader.weights import load_model

        self.model = load_model(self.config)
        if self.config.transfer.role == "encode":
            self.model.keep_vision_only()  # an encode worker never runs the text decoder
        self.draft_head = self._load_draft_head()
        quantize_weights(self.model, self.config.quantization,  # --quantization int8
                         lm_head=self.config.quantize_lm_head)
        # CPU fp32: oneDNN-blocked GEMM weights (compiled decode steps read the dense ones)
        prepack_weights(self.model, keep_dense=self.config.compile_decode and compile_applies(
            self.config, self.draft_head is not None) is None)
        if self.draft_head is not None:
            prepack_weights(self.draft_head)

    def _load_draft_head(self):
        """The EAGLE head of speculative_config, or None."""
        from foveal.worker.spec_decode import uses_draft_model

        spec = self.config.speculative
        if spec is None or not uses_draft_model(spec.method):
            return None
        from foveal.loader.eagle_config import load_eagle_config
        from foveal.loader.weights import load_draft_head

        head_config = load_eagle_config(spec.method, spec.model, self.config.model.text)
        return load_draft_head(head_config, self.model, self.config.device, self.config.dtype)

    def determine_num_blocks(self) -> int:
        """Blocks this rank's memory holds; call after load_model, so free
        device memory already excludes the weights."""
        if self.config.transfer.role == "encode":
            return 0
        memory_bytes = available_kv_memory(self.config.cache, self.config.device)
        if self.draft_head is not None:  # the head's KV shares the pool's block ids
            block = self.kv_cache_spec.block_bytes
            draft = draft_cache_block_bytes(self.draft_head, self.kv_cache_spec.block_size,
                                            torch_dtype(self.config.dtype))
            memory_bytes = memory_bytes * block // (block + draft)
        scheduler = self.config.scheduler
        return self.kv_cache_spec.num_blocks_for(memory_bytes, scheduler.max_model_len,
                                                 scheduler.max_num_batched_tokens)

    def get_kv_cache_spec(self) -> KVCacheSpec:
        return self.kv_cache_spec

    def initialize_cache(self, num_blocks: int) -> None:
        kv_caches = self.kv_cache_spec.allocate(num_blocks, self.config.device)
        kv_offload = (KVOffloadWorker.from_config(self.config.cache, kv_caches)
                      if self.config.cache.kv_offload else None)
        self.model_runner = ModelRunner(self.config, self.model, kv_caches, kv_offload,
                                        self.encoder_connector, self.draft_head)

    def execute(self, plan: StepPlan, mm_payloads: dict[str, dict] | None = None
                ) -> ModelRunnerOutput:
        if self.model_runner is None:
            raise EngineDeadError("the worker was shut down; start a new engine")
        return self.model_runner.execute(plan, mm_payloads or {})

    def encode(self, features: list[MMFeature], payloads: dict[str, dict]) -> dict:
        """An encode worker's step: every item through the vision tower.
        -> {"embeddings": mm_hash -> host tensor, "failed": mm_hash -> why}."""
        cache = EncoderCache()
        with torch.inference_mode():
            result = cache.encode(self.model, [
                (f.mm_hash, f.with_payload(payloads.get(f.mm_hash, {}))) for f in features])
        return {"embeddings": {f.mm_hash: cache.get(f.mm_hash).to("cpu")
                               for f in features if f.mm_hash in cache},
                "failed": result.failed_requests}

    def shutdown(self) -> None:
        """Drop the model and the KV cache so their memory can be reused."""
        self.model_runner = None
        self.model = None
        self.draft_head = None
