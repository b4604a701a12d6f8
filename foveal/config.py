"""Frozen configuration, one dataclass per subsystem.

HF `config.json` is read once, at the edge (`foveal.loader.hf_config`);
layers and models take these dataclasses or plain ints, never an HF config.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE frequency rescaling from the checkpoint's rope_parameters / rope_scaling.

    "linear": every frequency / factor. "llama3" (Llama 3.1+): wavelengths beyond
    original_max_position_embeddings / low_freq_factor are stretched by factor, those
    below original / high_freq_factor are kept, the band between is interpolated.
    """

    rope_type: str  # "linear" | "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, ...]  # sums to head_dim // 2
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str = "silu"
    attention_bias: bool = True  # q/k/v projection bias (Qwen2: yes; Llama / Mistral: no)
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    # Sparse MoE MLPs (Qwen3-VL-MoE); num_experts 0: every layer is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1  # every n-th layer is sparse
    mlp_only_layers: tuple[int, ...] = ()  # dense even so
    # Per decoder layer, its sliding window in tokens, 0 for full attention (Gemma 3);
    # empty: every layer attends to the whole context.
    layer_windows: tuple[int, ...] = ()

    def is_moe_layer(self, index: int) -> bool:
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)


@dataclass(frozen=True)
class VisionConfig:
    variant: str  # "qwen2_vl" | "qwen2_5_vl"
    depth: int
    hidden_size: int  # width of the vision blocks (HF: embed_dim for Qwen2-VL)
    num_heads: int
    intermediate_size: int  # MLP width (Qwen2-VL: embed_dim * mlp_ratio)
    out_hidden_size: int  # merger output = text hidden size
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    hidden_act: str
    window_size: int = 0  # Qwen2.5-VL window attention, in pixels
    fullatt_block_indexes: tuple[int, ...] = ()
    tokens_per_second: int = 0  # Qwen2.5-VL video time alignment
    num_position_embeddings: int = 0  # Qwen3-VL learned position table (a square grid)
    # Qwen3-VL DeepStack: vision blocks whose merged outputs are added to the
    # first len(...) decoder layers' hidden states at the visual positions.
    deepstack_visual_indexes: tuple[int, ...] = ()


# vLLM's --quantization names for a pre-quantized checkpoint's own method -> the method
# name Foveal's loader gives it (CheckpointQuantization.method). Naming the checkpoint's
# method changes nothing: the loader reads the method from config.json either way.
CHECKPOINT_METHOD_NAMES = {"gptq": "gptq", "gptq_marlin": "gptq", "awq": "awq",
                           "awq_marlin": "awq", "fp8": "fp8", "compressed-tensors": "fp8"}


@dataclass(frozen=True)
class CheckpointQuantization:
    """How a pre-quantized checkpoint stores its linear weights (config.json's
    quantization_config); the loader dequantizes them to float at load time."""
    method: str  # "gptq" | "awq" | "fp8"
    bits: int = 8
    group_size: int = -1  # input channels per scale; -1: one group per output row
    zero_offset: int = 0  # added to stored zero points (GPTQ v1 stores them minus one)
    block_size: tuple[int, ...] = ()  # fp8: (rows, cols) a block scale covers
    requires_g_idx: bool = False  # GPTQ desc_act: groups are permuted, so each layer stores g_idx

    def describe(self) -> str:
        if self.method == "fp8":
            return f"fp8 (blocks {'x'.join(map(str, self.block_size))})" if self.block_size else "fp8"
        groups = "per row" if self.group_size == -1 else f"group size {self.group_size}"
        order = ", desc_act" if self.requires_g_idx else ""
        return f"{self.method.upper()} {self.bits}-bit ({groups}{order})"


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # HF architecture string, e.g. "Qwen2VLForConditionalGeneration"
    model_type: str
    text: TextConfig
    vision: VisionConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...] = ()
    path: str | None = None  # checkpoint folder; None for dummy weights
    # With tensor parallelism: "weights" shards the vision encoder like the decoder;
    # "data" replicates it and splits each step's media items over the ranks.
    mm_encoder_tp_mode: str = "weights"
    checkpoint_dtype: str | None = None  # config.json's (torch_)dtype: how the weights are stored
    checkpoint_quantization: CheckpointQuantization | None = None  # None: float weights
    # Settings only one family has (a frozen dataclass from that family's config module,
    # e.g. models/gemma3_config.Gemma3Settings); None for the Qwen-VL families.
    family_config: object | None = None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # Storage dtype of KV blocks: "auto" (the model's dtype) or a dtype name.
    kv_cache_dtype: str = "auto"
    # Bytes for the KV pool; None: gpu_memory_utilization of free device memory
    # (CUDA) or cpu_kv_cache_fraction of available RAM (CPU).
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_fraction: float = 0.1
    enable_prefix_caching: bool = True
    # Encoder cache capacity, in embedding rows (visual tokens).
    encoder_cache_size: int = 16384
    # Second tier for evicted prefix-cache blocks: None | "cpu" (RAM) | "disk".
    kv_offload: str | None = None
    kv_offload_bytes: int = 1 << 30
    kv_offload_path: str | None = None  # folder for "disk"
    # Sliding-window layers keep every block, as full-attention ones do, instead of
    # taking their own blocks and giving back those their window has left.
    disable_hybrid_kv_cache_manager: bool = False


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    # Visual tokens the vision encoder may produce in one step.
    encoder_compute_budget: int = 16384
    # Inter-token latency to aim at: a step that carries decode rows takes only the
    # prompt tokens (and vision encoding) its measured step cost says fit in this
    # many ms (foveal/engine/step_cost.py). None: every step fills its token budget.
    target_itl_ms: float | None = None


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over worker processes."""

    tensor_parallel_size: int = 1
    # Executor name in foveal.executor's registry: "uni" runs the one worker in
    # the engine's own process; "mp" one process per rank.
    distributed_executor_backend: str = "uni"
    # A collective that waits longer than this (a rank hung or died) fails the engine.
    collective_timeout_s: float = 60.0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config` keys).

    method: a proposer in foveal.worker.spec_decode's registry ("ngram").
    num_speculative_tokens: drafts verified per step and request.
    prompt_lookup_min / prompt_lookup_max: n-gram sizes the ngram proposer
    matches against the request's own tokens (longest first).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None  # draft checkpoint (EAGLE heads)


@dataclass(frozen=True)
class MultimodalConfig:
    limit_mm_per_prompt: dict[str, int] = field(default_factory=lambda: {"image": 8, "video": 1})
    max_image_pixels: int = 50_000_000
    mm_processor_kwargs: dict = field(default_factory=dict)
    # Byte cap of the processed-media cache (pixel tensors); 0 turns it off.
    processor_cache_size: int = 256 << 20


ROLES = ("mixed", "encode", "prefill", "decode")


@dataclass(frozen=True)
class TransferConfig:
    """Disaggregated serving: this engine's role and how it exchanges data.

    role: "mixed" serves whole requests; "encode" runs only the vision tower
        and exports embeddings by mm_hash; "prefill" and "decode" are whole
        engines that export (prefill) or import (decode) a prompt's KV when a
        request says so (any role but "encode" honours both).
    host / advertise_host / port: where this engine's exports are served
        (port 0: a free one; advertise_host: the name peers dial, if not host).
    buffer_bytes: exports held for peers; ttl_s: how long an unclaimed KV
        export is kept; timeout_s: the longest wait for one pull from a peer.
    load_failure_policy: a pull that fails (peer gone, expired, corrupt,
        mismatched) is "recompute"d here (the engine holds the whole request)
        or "fail"s the request (TransferError, HTTP 503).
    """

    role: str = "mixed"
    host: str = "127.0.0.1"
    advertise_host: str | None = None
    port: int = 0
    buffer_bytes: int = 2 << 30
    ttl_s: float = 120.0
    timeout_s: float = 30.0
    load_failure_policy: str = "recompute"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    multimodal: MultimodalConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = None
    transfer: TransferConfig = field(default_factory=TransferConfig)
    dtype: str = "float32"  # resolved torch dtype name
    device: str = "cpu"  # resolved device
    load_format: str = "auto"  # "auto" (safetensors) | "dummy"
    seed: int = 0
    quantization: str | None = None  # online weight quantization: "int8" (W8A8 dynamic)
    quantize_lm_head: bool = False  # with int8: the LM head too (an int8 copy; a tied embedding stays)
    enforce_eager: bool = False  # CUDA: no CUDA graphs for decode steps
    compile_decode: bool = False  # CPU: steps of a few tokens through torch.compile
