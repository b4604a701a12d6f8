"""Engine flags shared by every subcommand that loads a model (vLLM spelling)."""
from __future__ import annotations

import argparse
import json
from typing import Any

from foveal.config import CHECKPOINT_METHOD_NAMES
from foveal.errors import ConfigError


def _limit_mm(value: str) -> dict[str, int]:
    """`image=4,video=1` or JSON `{"image": 4}`."""
    if value.strip().startswith("{"):
        return {k: int(v) for k, v in json.loads(value).items()}
    limits = {}
    for item in value.split(","):
        modality, _, count = item.partition("=")
        if not count.isdigit():
            raise argparse.ArgumentTypeError(f"expected MODALITY=N, got {item!r}")
        limits[modality.strip()] = int(count)
    return limits


def _json_dict(value: str) -> dict:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not valid JSON: {error}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return parsed


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--dtype", default="auto",
                       help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16")
    group.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    group.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    group.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="tokens per engine step (prefill chunks + decodes)")
    group.add_argument("--kv-cache-memory-bytes", type=int,
                       help="KV pool size (default: a fraction of free memory)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    group.add_argument("--kv-cache-dtype", default="auto",
                       help="KV block storage: auto (the model dtype), float32, bfloat16, "
                            "float16, or quantized: int8, fp8 (fp8_e4m3), int4")
    group.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                       action="store_false", help="turn prefix caching off")
    group.add_argument("--encoder-cache-size", type=int, default=16384,
                       help="encoder cache capacity, in visual tokens")
    group.add_argument("--encoder-compute-budget", type=int, default=16384,
                       help="visual tokens the vision encoder may produce per step")
    group.add_argument("--target-itl-ms", type=float,
                       help="inter-token latency to aim at: while requests decode, each step "
                            "takes only the prompt tokens and vision encoding its measured "
                            "cost says fit in this many ms (default: steps fill "
                            "--max-num-batched-tokens)")
    group.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                       help="dummy: random weights at the checkpoint's shapes")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--limit-mm-per-prompt", type=_limit_mm, default={},
                       help="max media items per prompt, e.g. image=4")
    group.add_argument("--mm-processor-kwargs", type=_json_dict, default={},
                       help='processor overrides, e.g. \'{"max_pixels": 401408}\'')
    group.add_argument("--max-image-pixels", type=int, default=50_000_000,
                       help="reject decoded images larger than this")
    group.add_argument("--processor-cache-size", type=int, default=256 << 20,
                       help="bytes of processed media (pixel tensors) kept for repeats; 0: off")
    group.add_argument("--kv-offload", choices=["cpu", "disk"],
                       help="keep evicted prefix-cache KV blocks in RAM or on disk")
    group.add_argument("--kv-offload-bytes", type=int, default=1 << 30,
                       help="size of the KV offload tier")
    group.add_argument("--kv-offload-path", help="folder for --kv-offload disk")
    group.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                       help="sliding-window layers (Gemma 3) keep every KV block like "
                            "full-attention ones, instead of their own blocks freed once "
                            "out of the window")
    group.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                       help="worker processes the model is split over")
    group.add_argument("--distributed-executor-backend",
                       help="executor that runs the workers: uni (in-process; the default "
                            "for one rank) or mp (one process per rank; the default for more)")
    group.add_argument("--mm-encoder-tp-mode", choices=("weights", "data"), default="weights",
                       help="with -tp > 1: shard the vision encoder's weights, or replicate it "
                            "and split each step's images and videos over the ranks")
    group.add_argument("--speculative-config", type=_json_dict, default=None,
                       help='speculative decoding, e.g. \'{"method": "ngram", '
                            '"num_speculative_tokens": 3}\'')
    group.add_argument("--quantization", choices=("int8", *CHECKPOINT_METHOD_NAMES),
                       help="quantize the linear layers' weights at load time: int8 (per output "
                            "channel, activations per token at run time; CPU); or name a "
                            "pre-quantized checkpoint's own method (gptq, awq, fp8, their vLLM "
                            "aliases), which is read from config.json anyway")
    group.add_argument("--quantize-lm-head", action="store_true",
                       help="with --quantization int8: quantize the LM head too (the largest single "
                            "weight a decode step reads; logits move by the int8 rounding)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="CUDA: run every step eagerly (decode steps are otherwise replayed "
                            "from CUDA graphs captured at start, one per batch size bucket)")
    group.add_argument("--compile-decode", action="store_true",
                       help="CPU: run decode steps of up to 4 tokens as torch.compile (Inductor) "
                            "graphs: fused elementwise ops and weight-streaming GEMVs. Compiles at "
                            "start (needs g++) and keeps dense weights beside the blocked ones")


_ENGINE_KEYS = ("dtype", "device", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                "kv_cache_memory_bytes", "block_size", "enable_prefix_caching", "load_format",
                "encoder_cache_size", "encoder_compute_budget", "target_itl_ms",
                "seed", "limit_mm_per_prompt", "mm_processor_kwargs", "max_image_pixels",
                "processor_cache_size", "kv_offload", "kv_offload_bytes", "kv_offload_path",
                "disable_hybrid_kv_cache_manager",
                "kv_cache_dtype", "tensor_parallel_size", "distributed_executor_backend",
                "mm_encoder_tp_mode", "speculative_config", "quantization", "quantize_lm_head",
                "enforce_eager", "compile_decode")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs = {key: getattr(args, key) for key in _ENGINE_KEYS}
    if kwargs["max_num_seqs"] < 1:
        raise ConfigError("--max-num-seqs must be >= 1")
    return kwargs
