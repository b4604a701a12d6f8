"""`foveal bench multiturn`: what the prefix, encoder and processor caches and
the KV offload tier buy on a multi-turn image chat, caching on vs off in one run.

Each conversation has its own seeded random image. Per conversation, with
max_tokens=1 (the wall time of a 1-token generate is the TTFT offline):
  cold    turn 1 (new image, question 1)
  turn2   turn 1 + an answer + question 2 (same image, new question)
  repeat  turn 1 again, exactly
The 0%-hit cost is the output throughput of a batch of prompts that share
nothing (unique leading text, new images). The offload run uses a KV pool
barely larger than one max_model_len request, floods it with unrelated prompts
so every conversation's blocks are evicted, then repeats turn 1.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from foveal.bench.model_source import add_model_source_args, model_dir_from_args
from foveal.bench.workload import parse_image_size
from foveal.entrypoints.cli_args import add_engine_args, engine_kwargs
from foveal.sampling_params import SamplingParams

FIRST_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@dataclass(frozen=True)
class MultiturnSpec:
    num_conversations: int = 8
    image_size: tuple[int, int] = (448, 448)
    output_len: int = 32  # for the 0%-hit throughput batch
    seed: int = 0


def random_image(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    width, height = size
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def conversations(spec: MultiturnSpec, salt: int = 0) -> list[tuple[list[dict], list[dict]]]:
    """(turn 1 messages, turn 2 messages) per conversation."""
    rng = np.random.default_rng([spec.seed, salt])
    result = []
    for index in range(spec.num_conversations):
        image = random_image(rng, spec.image_size)
        turn1 = [{"role": "user", "content": [
            {"type": "image_pil", "image_pil": image},
            {"type": "text", "text": f"Conversation {index}: what is in this picture?"}]}]
        turn2 = turn1 + [{"role": "assistant", "content": "A field of coloured noise."},
                         {"role": "user", "content": "Which colour dominates its top left corner?"}]
        result.append((turn1, turn2))
    return result


def unique_prompts(spec: MultiturnSpec, salt: int) -> list[dict]:
    """Prompts sharing no prefix: unique leading text and a new image each."""
    rng = np.random.default_rng([spec.seed, salt, 1])
    return [{"prompt": f"Request {salt}-{index} asks: <|vision_start|><|image_pad|><|vision_end|>"
                       "Describe the picture.",
             "multi_modal_data": {"image": random_image(rng, spec.image_size)}}
            for index in range(spec.num_conversations)]


def _ttft(llm, messages: list[dict]) -> float:
    start = time.perf_counter()
    llm.chat(messages, FIRST_TOKEN, use_tqdm=False)
    return time.perf_counter() - start


def measure_turns(llm, spec: MultiturnSpec, salt: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"cold": [], "turn2": [], "repeat": []}
    for turn1, turn2 in conversations(spec, salt):
        times["cold"].append(_ttft(llm, turn1))
        times["turn2"].append(_ttft(llm, turn2))
        times["repeat"].append(_ttft(llm, turn1))
    return {f"{name}_ttft_s": statistics.median(values) for name, values in times.items()}


def measure_throughput(llm, spec: MultiturnSpec, salt: int) -> float:
    """Output tokens/s of a batch with no prefix in common (0% hit rate)."""
    params = SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(unique_prompts(spec, salt), params, use_tqdm=False)
    wall = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / wall


def measure_offload(llm, spec: MultiturnSpec, salt: int) -> dict[str, float]:
    turns = conversations(spec, salt)
    cold = [_ttft(llm, turn1) for turn1, _ in turns]
    measure_throughput(llm, spec, salt + 1)  # evicts every conversation's blocks
    repeat = [_ttft(llm, turn1) for turn1, _ in turns]
    metrics = llm.get_metrics()
    return {"cold_ttft_s": statistics.median(cold), "repeat_ttft_s": statistics.median(repeat),
            "kv_offload_hits": metrics["foveal:kv_offload_hits_total"],
            "kv_offload_bytes": metrics["foveal:kv_offload_bytes"]}


def _cache_metrics(llm) -> dict[str, float]:
    metrics = llm.get_metrics()
    names = ("prefix_cache_queries_total", "prefix_cache_hits_total", "encoder_items_total",
             "encoder_cache_hits_total", "processor_cache_hits_total")
    return {name: metrics[f"foveal:{name}"] for name in names}


def load_mode(model_dir: Path, engine_kwargs: dict, caching: bool):
    from foveal import LLM

    options = {**engine_kwargs, "enable_prefix_caching": caching}
    if not caching:
        options["processor_cache_size"] = 0
    return LLM(model=str(model_dir), **options)


def run_modes(model_dir: Path, spec: MultiturnSpec, engine_kwargs: dict,
              rounds: int = 3) -> tuple[dict, dict]:
    """Caching on and off, both loaded; throughput rounds alternate between them
    so load from other processes on a shared machine hits both alike."""
    llms = {mode: load_mode(model_dir, engine_kwargs, mode == "on") for mode in ("on", "off")}
    try:
        results = {}
        for mode, llm in llms.items():
            measure_turns(llm, MultiturnSpec(1, spec.image_size, 4, spec.seed), salt=99)
            results[mode] = measure_turns(llm, spec, salt=1)
        throughput: dict[str, list[float]] = {"on": [], "off": []}
        for index in range(rounds):
            for mode, llm in llms.items():
                throughput[mode].append(measure_throughput(llm, spec, salt=10 + index))
        for mode, llm in llms.items():
            results[mode]["zero_hit_output_tok_s"] = statistics.median(throughput[mode])
            results[mode].update(_cache_metrics(llm))
        return results["on"], results["off"]
    finally:
        for llm in llms.values():
            llm.shutdown()
        gc.collect()


def run_offload(model_dir: Path, spec: MultiturnSpec, engine_kwargs: dict,
                tier: str | None) -> dict:
    """Small KV pool; tier None is the same run without the offload tier."""
    from foveal import LLM

    llm = LLM(model=str(model_dir), **engine_kwargs, kv_offload=tier)
    try:
        measure_turns(llm, MultiturnSpec(1, spec.image_size, 4, spec.seed), salt=98)
        return measure_offload(llm, spec, salt=3)
    finally:
        llm.shutdown()
        gc.collect()


def small_pool_bytes(model_dir: Path, engine_kwargs: dict) -> int:
    """KV bytes for one max_model_len request plus a few blocks."""
    from foveal.engine_args import EngineArgs
    from foveal.worker.kv_cache import kv_cache_spec

    config = EngineArgs.from_kwargs(str(model_dir), **engine_kwargs).create_engine_config()
    spec = kv_cache_spec(config.model, config.cache, config.dtype)
    return (-(-config.scheduler.max_model_len // spec.block_size) + 4) * spec.block_bytes


def run_multiturn(model_dir: Path, spec: MultiturnSpec, engine_kwargs: dict) -> dict:
    on, off = run_modes(model_dir, spec, engine_kwargs)
    small = {**engine_kwargs, "kv_cache_memory_bytes": small_pool_bytes(model_dir, engine_kwargs)}
    offload = run_offload(model_dir, spec, small, "cpu")
    no_offload = run_offload(model_dir, spec, small, None)
    ratios = {
        "turn2_over_cold": on["turn2_ttft_s"] / on["cold_ttft_s"],
        "repeat_over_cold": on["repeat_ttft_s"] / on["cold_ttft_s"],
        "zero_hit_throughput_cost": 1 - on["zero_hit_output_tok_s"] / off["zero_hit_output_tok_s"],
        "offload_repeat_over_cold": offload["repeat_ttft_s"] / offload["cold_ttft_s"],
        "evicted_repeat_over_cold_without_tier": no_offload["repeat_ttft_s"] / no_offload["cold_ttft_s"],
    }
    return {"caching_on": on, "caching_off": off, "offload_cpu": offload,
            "no_offload_small_pool": no_offload, "ratios": ratios}


def format_report(report: dict) -> str:
    on, off = report["caching_on"], report["caching_off"]
    rows = ["| measure | caching on | caching off |", "|---|---|---|"]
    for key in ("cold_ttft_s", "turn2_ttft_s", "repeat_ttft_s"):
        rows.append(f"| {key} (median) | {on[key] * 1e3:.1f} ms | {off[key] * 1e3:.1f} ms |")
    rows.append(f"| 0%-hit output tok/s | {on['zero_hit_output_tok_s']:.1f} | "
                f"{off['zero_hit_output_tok_s']:.1f} |")
    small = report["offload_cpu"], report["no_offload_small_pool"]
    rows.append(f"| small pool, evicted repeat / cold TTFT | {small[0]['repeat_ttft_s'] * 1e3:.1f} / "
                f"{small[0]['cold_ttft_s'] * 1e3:.1f} ms (cpu tier) | "
                f"{small[1]['repeat_ttft_s'] * 1e3:.1f} / {small[1]['cold_ttft_s'] * 1e3:.1f} ms "
                "(no tier) |")
    ratios = "\n".join(f"{name}: {value:.3f}" for name, value in report["ratios"].items())
    return "\n".join(rows) + "\n" + ratios


def run_bench_multiturn(args: argparse.Namespace) -> int:
    spec = MultiturnSpec(args.num_conversations, parse_image_size(args.image_size),
                         args.output_len, args.seed)
    model_dir = model_dir_from_args(args)
    kwargs = engine_kwargs(args)
    kwargs.pop("enable_prefix_caching")
    kwargs.pop("kv_offload")
    print(f"model: {model_dir}; {spec}", flush=True)
    report = run_multiturn(model_dir, spec, kwargs)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps({"spec": asdict(spec), "engine_kwargs": kwargs,
                                               **report}, indent=2, default=str) + "\n")
    return 0


def register_multiturn(bench_commands) -> None:
    parser = bench_commands.add_parser(
        "multiturn", help="multi-turn image chat: caching on vs off, offload tier",
        description=__doc__.split("\n\n")[0])
    add_model_source_args(parser)
    parser.add_argument("--num-conversations", type=int, default=8)
    parser.add_argument("--image-size", default="448x448", help="WIDTHxHEIGHT")
    parser.add_argument("--output-len", type=int, default=32,
                        help="output tokens per request of the 0%%-hit throughput batch")
    parser.add_argument("--json", metavar="OUT", help="write every number here")
    add_engine_args(parser)
    parser.set_defaults(func=run_bench_multiturn)
