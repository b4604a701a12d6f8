"""`foveal bench throughput`: offline throughput on a seeded multimodal
workload, optionally against transformers on the same checkpoint folder."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from foveal.bench.kv_cache import register_kv_cache
from foveal.bench.model_source import add_model_source_args, model_dir_from_args
from foveal.bench.multiturn import register_multiturn
from foveal.bench.peer import register_peer
from foveal.bench.report import write_json_report
from foveal.bench.serve import register_serve
from foveal.bench.soak import register_soak
from foveal.bench.stages import register_stages
from foveal.bench.sweep import register_sweep
from foveal.bench.video import register_video
from foveal.bench.workload import add_workload_args, workload_spec_from_args
from foveal.entrypoints.cli_args import add_engine_args, engine_kwargs
from foveal.errors import ConfigError


def _batch_sizes(value: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(item) for item in value.split(",") if item.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {value!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {value!r}")
    return sizes


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = engine_kwargs(args)
    limits = dict(kwargs["limit_mm_per_prompt"])
    limits.setdefault("image", max(1, args.images_per_prompt))
    kwargs["limit_mm_per_prompt"] = limits
    return kwargs


def _finite(value):
    """NaN (no samples) -> null, so the report is strict JSON."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def run_bench_throughput(args: argparse.Namespace) -> int:
    from foveal.bench.report import format_table
    from foveal.bench.throughput import ThroughputPlan, run_throughput
    from foveal.bench.workload import workload_summary

    if args.baseline and not args.hf_batch_sizes:
        raise ConfigError("--hf-batch-sizes is empty; give at least one batch size")
    spec = workload_spec_from_args(args)
    plan = ThroughputPlan(model_dir=model_dir_from_args(args), workload=spec,
                          engine_kwargs=_engine_kwargs(args),
                          hf_batch_sizes=args.hf_batch_sizes if args.baseline == "hf" else ())
    print(f"model: {plan.model_dir}" + (f" (dummy preset {args.dummy})" if args.dummy else ""))
    print(f"workload: {json.dumps(workload_summary(spec))}", flush=True)
    report = run_throughput(plan)
    print(format_table(report["results"]))
    if report["speedup_vs_hf"] is not None:
        print(f"foveal / hf output tokens/s: {report['speedup_vs_hf']:.2f}x "
              f"(best hf batch size {report['best_hf_batch_size']})")
    if args.json:
        _write_json(Path(args.json), args, plan, report)
    return 0


def _write_json(path: Path, args: argparse.Namespace, plan, report: dict) -> None:
    from foveal.bench.workload import workload_summary

    arguments = {key: value for key, value in vars(args).items() if key != "func"}
    write_json_report(path, _finite({
        "arguments": arguments, "model_dir": str(plan.model_dir),
        "engine_kwargs": plan.engine_kwargs, "workload": workload_summary(plan.workload),
        **report}))


def register(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks",
                                  description="Benchmarks on synthetic workloads.")
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK",
                                          required=True)
    throughput = bench_commands.add_parser(
        "throughput", help="offline throughput, optionally vs transformers",
        description="Time one offline generate() over a seeded multimodal workload (random "
                    "images and text, EOS ignored); with --baseline hf, run the same workload "
                    "through transformers' generate() on the same checkpoint folder.")
    add_model_source_args(throughput)
    add_workload_args(throughput)
    baseline = throughput.add_argument_group("baseline")
    baseline.add_argument("--baseline", choices=["hf"], help="also run transformers")
    baseline.add_argument("--hf-batch-sizes", type=_batch_sizes, default=(1, 8, 32),
                          help="static batch sizes to try (default 1,8,32)")
    throughput.add_argument("--json", metavar="OUT", help="write every number here")
    add_engine_args(throughput)
    throughput.set_defaults(func=run_bench_throughput)

    register_serve(bench_commands)
    register_soak(bench_commands)
    register_multiturn(bench_commands)
    register_stages(bench_commands)
    register_video(bench_commands)
    register_kv_cache(bench_commands)
    register_sweep(bench_commands)
    register_peer(bench_commands)
