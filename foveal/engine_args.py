"""User-facing engine options -> the frozen EngineConfig.

One place turns keyword arguments (LLM(...), CLI flags, server flags) into
configuration, so every entrypoint spells options the same way.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace

from foveal.config import (ROLES, CacheConfig, EngineConfig, ModelConfig, MultimodalConfig,
                           ParallelConfig, SchedulerConfig, SpeculativeConfig, TextConfig,
                           TransferConfig)
from foveal.errors import ConfigError
from foveal.logger import init_logger

logger = init_logger(__name__)


@dataclass
class EngineArgs:
    model: str
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    encoder_cache_size: int = 16384
    encoder_compute_budget: int = 16384
    target_itl_ms: float | None = None  # steps with decode rows: prompt chunks sized to this
    load_format: str = "auto"
    seed: int = 0
    limit_mm_per_prompt: dict[str, int] = field(default_factory=dict)
    mm_processor_kwargs: dict = field(default_factory=dict)
    max_image_pixels: int = 50_000_000
    processor_cache_size: int = 256 << 20
    kv_offload: str | None = None
    kv_offload_bytes: int = 1 << 30
    kv_offload_path: str | None = None
    # Sliding-window layers keep every block (no own blocks, no eviction).
    disable_hybrid_kv_cache_manager: bool = False
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    mm_encoder_tp_mode: str = "weights"  # "data": replicate the vision encoder, split items
    speculative_config: dict | None = None
    quantization: str | None = None  # "int8": W8A8, dynamic per-token activations (CPU)
    quantize_lm_head: bool = False  # with quantization="int8": the LM head as well
    enforce_eager: bool = False  # CUDA: run decode steps eagerly, never as CUDA graphs
    # CPU: decode steps of up to 4 tokens as Inductor graphs (foveal/worker/compiled_decode.py);
    # compiles at start, keeps dense weights beside the blocked ones
    compile_decode: bool = False
    role: str = "mixed"  # disaggregated serving: encode | prefill | decode | mixed
    transfer_host: str = "127.0.0.1"
    transfer_advertise_host: str | None = None
    transfer_port: int = 0
    transfer_buffer_bytes: int = 2 << 30
    transfer_ttl_s: float = 120.0
    transfer_timeout_s: float = 30.0
    kv_load_failure_policy: str = "recompute"  # or "fail"

    @classmethod
    def from_kwargs(cls, model: str, **kwargs) -> "EngineArgs":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; accepted: {sorted(known)}")
        return cls(model=model, **kwargs)

    def create_engine_config(self) -> EngineConfig:
        from foveal.layers.quantization import check_quantization
        from foveal.loader.hf_config import model_config_from_hf
        from foveal.worker.device import resolve_device, resolve_dtype

        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ConfigError(f"load_format={self.load_format!r}; use 'auto' or 'dummy'")
        if self.target_itl_ms is not None and not self.target_itl_ms > 0:
            raise ConfigError(f"target_itl_ms={self.target_itl_ms!r}; use a positive number of "
                              "milliseconds, or leave it unset")
        model_config = model_config_from_hf(self.model)
        if self.mm_encoder_tp_mode not in ("weights", "data"):
            raise ConfigError(f"mm_encoder_tp_mode={self.mm_encoder_tp_mode!r}; use 'weights' "
                              "(shard the vision encoder) or 'data' (replicate it, split items)")
        model_config = replace(model_config, mm_encoder_tp_mode=self.mm_encoder_tp_mode)
        device = resolve_device(self.device)
        max_model_len = self.max_model_len or model_config.text.max_position_embeddings
        if max_model_len > model_config.text.max_position_embeddings:
            raise ConfigError(
                f"max_model_len={max_model_len} exceeds the model's "
                f"max_position_embeddings={model_config.text.max_position_embeddings}")
        kv_cache_dtype = self._check_cache_options()
        parallel = self._parallel_config()
        self._check_tensor_parallel(parallel.tensor_parallel_size, model_config, device)
        limits = {"image": 8, "video": 1, **self.limit_mm_per_prompt}
        dtype = resolve_dtype(self.dtype, device, model_config.checkpoint_dtype)
        checkpoint = model_config.checkpoint_quantization
        quantization = check_quantization(self.quantization, device,
                                          checkpoint.method if checkpoint else None)
        if self.quantize_lm_head and quantization is None:
            raise ConfigError("quantize_lm_head needs quantization='int8' (--quantization int8)")
        if device == "cpu":
            from foveal import allocator
            from foveal.cpu_features import cpu_features
            from foveal.layers.linear import describe_linear_layout

            logger.info("CPU: %s; dtype %s -> %s; linear weights %s; allocator %s",
                        cpu_features().describe(), self.dtype, dtype, describe_linear_layout(),
                        allocator.describe())
            if quantization == "int8":
                from foveal.layers.quantization import int8_kernel

                logger.info("int8 weights: the %s kernel", int8_kernel())
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(block_size=self.block_size,
                              kv_cache_dtype=dtype if kv_cache_dtype == "auto" else kv_cache_dtype,
                              kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              enable_prefix_caching=self.enable_prefix_caching,
                              encoder_cache_size=self.encoder_cache_size,
                              kv_offload=self.kv_offload, kv_offload_bytes=self.kv_offload_bytes,
                              kv_offload_path=self.kv_offload_path,
                              disable_hybrid_kv_cache_manager=self.disable_hybrid_kv_cache_manager),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_model_len=max_model_len,
                                      encoder_compute_budget=self.encoder_compute_budget,
                                      target_itl_ms=self.target_itl_ms),
            multimodal=MultimodalConfig(limit_mm_per_prompt=limits,
                                        max_image_pixels=self.max_image_pixels,
                                        mm_processor_kwargs=dict(self.mm_processor_kwargs),
                                        processor_cache_size=self.processor_cache_size),
            parallel=parallel,
            speculative=self._speculative_config(max_model_len, model_config.text),
            transfer=self._transfer_config(parallel.tensor_parallel_size),
            dtype=dtype,
            device=device,
            load_format=self.load_format,
            seed=self.seed,
            quantization=quantization,
            quantize_lm_head=self.quantize_lm_head,
            enforce_eager=self.enforce_eager,
            compile_decode=self.compile_decode,
        )

    def _speculative_config(self, max_model_len: int, text: TextConfig
                            ) -> SpeculativeConfig | None:
        from foveal.loader.eagle_config import load_eagle_config
        from foveal.worker.spec_decode import get_proposer_class, uses_draft_model

        options = self.speculative_config
        if not options:
            return None
        if not isinstance(options, dict) or "method" not in options:
            raise ConfigError(f"speculative_config needs a 'method' (e.g. {{'method': 'ngram', "
                              f"'num_speculative_tokens': 3}}), got {options!r:.100}")
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown speculative_config key(s) {unknown}; accepted: "
                              f"{sorted(known)}")
        get_proposer_class(options["method"])
        config = SpeculativeConfig(**{"num_speculative_tokens": 3, **options})
        k = config.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k < max_model_len - 1:
            raise ConfigError(f"num_speculative_tokens={k!r}; use an int in "
                              f"[1, {max_model_len - 2}] (below max_model_len)")
        if not 1 <= config.prompt_lookup_min <= config.prompt_lookup_max:
            raise ConfigError(f"prompt_lookup_min={config.prompt_lookup_min} and "
                              f"prompt_lookup_max={config.prompt_lookup_max}; use "
                              "1 <= prompt_lookup_min <= prompt_lookup_max")
        if uses_draft_model(config.method):
            load_eagle_config(config.method, config.model, text)  # ConfigError if it does not fit
        elif config.model is not None:
            raise ConfigError(f"speculative method {config.method!r} takes no draft 'model'")
        return config

    def _transfer_config(self, tp_size: int) -> TransferConfig:
        if self.role not in ROLES:
            raise ConfigError(f"role={self.role!r}; use one of {', '.join(ROLES)} (--role)")
        if self.role in ("prefill", "decode") and tp_size > 1:
            raise ConfigError(f"role={self.role!r} moves a prompt's KV between engines, which "
                              "supports tensor_parallel_size=1 only for now")
        if not 0 <= self.transfer_port < 65536:
            raise ConfigError(f"transfer_port={self.transfer_port}; use 0 (any free port) or a "
                              "port number (--transfer-port)")
        for name in ("transfer_buffer_bytes", "transfer_ttl_s", "transfer_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)!r}; it must be > 0 "
                                  f"(--{name.replace('_', '-').removesuffix('-s')})")
        if self.kv_load_failure_policy not in ("recompute", "fail"):
            raise ConfigError(f"kv_load_failure_policy={self.kv_load_failure_policy!r}; use "
                              "recompute or fail (--kv-load-failure-policy)")
        return TransferConfig(self.role, self.transfer_host, self.transfer_advertise_host,
                              self.transfer_port, self.transfer_buffer_bytes,
                              self.transfer_ttl_s, self.transfer_timeout_s,
                              self.kv_load_failure_policy)

    def _parallel_config(self) -> ParallelConfig:
        from foveal.executor import executor_names

        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"tensor_parallel_size={size!r}; use a positive int (-tp N)")
        backend = self.distributed_executor_backend or ("mp" if size > 1 else "uni")
        if backend not in executor_names():
            raise ConfigError(f"distributed_executor_backend={backend!r} is unknown; registered: "
                              f"{executor_names()} (--distributed-executor-backend)")
        if size > 1 and backend == "uni":
            raise ConfigError(f"tensor_parallel_size={size} needs one worker process per rank; "
                              "'uni' runs one (use --distributed-executor-backend mp)")
        # FOVEAL_COLLECTIVE_TIMEOUT_S: how long a collective waits for a rank that hangs
        timeout = float(os.environ.get("FOVEAL_COLLECTIVE_TIMEOUT_S", 60))
        return ParallelConfig(tensor_parallel_size=size, distributed_executor_backend=backend,
                              collective_timeout_s=timeout)

    @staticmethod
    def _check_tensor_parallel(size: int, model: ModelConfig, device: str) -> None:
        """ConfigError unless every sharded dimension splits over `size` ranks and the
        machine has `size` devices (CUDA) or cores (CPU)."""
        if size == 1:
            return
        text, vision = model.text, model.vision
        sharded = {"attention heads": text.num_attention_heads, "MLP width": text.intermediate_size}
        if model.mm_encoder_tp_mode == "weights":
            sharded["vision MLP width"] = vision.intermediate_size
        for what, value in sharded.items():
            if value % size:
                raise ConfigError(f"tensor_parallel_size={size} does not divide the model's "
                                  f"{what} ({value}); use a divisor of it")
        kv_heads = text.num_key_value_heads
        if kv_heads % size and size % kv_heads:
            raise ConfigError(f"tensor_parallel_size={size} and {kv_heads} KV heads: each rank "
                              "needs whole KV heads (size divides them) or one replicated head "
                              "(they divide size)")
        if device.startswith("cuda"):
            import torch

            available, what = torch.cuda.device_count(), "CUDA devices"
        else:
            available, what = len(os.sched_getaffinity(0)), "CPU cores"
        if size > available:
            raise ConfigError(f"tensor_parallel_size={size} needs {size} {what}; this machine "
                              f"has {available}")

    def _check_cache_options(self) -> str:
        """Validate the cache options; returns the canonical kv_cache_dtype."""
        from foveal.layers.attention.kv_quant import (QUANTIZED_KV_DTYPES, canonical_kv_dtype,
                                                      get_kv_codec)
        from foveal.worker.device import DTYPE_NAMES

        if self.processor_cache_size < 0:
            raise ConfigError(f"processor_cache_size={self.processor_cache_size}; use bytes >= 0 "
                              "(0 turns the processor cache off)")
        kv_dtype = canonical_kv_dtype(self.kv_cache_dtype)
        if kv_dtype in QUANTIZED_KV_DTYPES:
            get_kv_codec(kv_dtype)  # raises if this torch cannot store it
        elif kv_dtype != "auto" and kv_dtype not in DTYPE_NAMES:
            raise ConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r}; use auto or one of "
                              f"{', '.join((*QUANTIZED_KV_DTYPES, *DTYPE_NAMES))} "
                              "(--kv-cache-dtype)")
        self._check_offload_options()
        return kv_dtype

    def _check_offload_options(self) -> None:
        from foveal.worker.kv_offload import BLOCK_STORES

        if self.kv_offload is None:
            return
        if self.kv_offload not in BLOCK_STORES:
            raise ConfigError(f"kv_offload={self.kv_offload!r}; use one of {sorted(BLOCK_STORES)} "
                              "or leave it unset")
        if not self.enable_prefix_caching:
            raise ConfigError("kv_offload keeps evicted prefix-cache blocks, so it needs "
                              "enable_prefix_caching=True (drop --no-enable-prefix-caching)")
        if self.kv_offload_bytes <= 0:
            raise ConfigError(f"kv_offload_bytes={self.kv_offload_bytes}; give the tier a positive "
                              "size (--kv-offload-bytes)")
        if self.kv_offload == "disk" and not self.kv_offload_path:
            raise ConfigError("kv_offload='disk' needs a folder: set kv_offload_path "
                              "(--kv-offload-path)")
