"""`foveal bench kv-cache`: what each KV cache dtype buys and what it costs.

For every --kv-dtypes entry, at one --kv-cache-memory-bytes, on the same
checkpoint: the pool's capacity in tokens; the most 1-image requests running
at once before the first preemption; output throughput on a KV-bound
workload (many image requests, that small pool); decode ms/token at long
context (--long-context tokens of prompt, a pool sized to hold it); and,
with --accuracy-prompts, teacher-forced top-1 agreement and mean |logit
difference| against the first dtype (foveal/bench/kv_accuracy.py).
--kv-layouts hybrid,plain runs each dtype twice on a model with sliding-window
layers: with its own blocks for those layers, freed once out of the window
(hybrid, the default), and with every layer in every block (plain,
--disable-hybrid-kv-cache-manager).
"""
from __future__ import annotations

import argparse
import gc
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from foveal.bench.model_source import add_model_source_args, model_dir_from_args
from foveal.bench.workload import (PromptVocab, WorkloadSpec, add_workload_args, build_workload,
                                   workload_summary, workload_spec_from_args)
from foveal.entrypoints.cli_args import add_engine_args, engine_kwargs


@dataclass
class KVBenchPlan:
    model_dir: Path
    dtypes: tuple[str, ...]
    workload: WorkloadSpec
    engine_kwargs: dict
    layouts: tuple[str, ...] = ("hybrid",)
    long_context: int = 8192
    decode_tokens: int = 32
    accuracy_prompts: int = 0
    accuracy_tokens: int = 256
    rows: list[dict] = field(default_factory=list)


def run_kv_bench(plan: KVBenchPlan) -> list[dict]:
    from foveal import LLM

    vocab = PromptVocab.from_model_dir(plan.model_dir)
    # The concurrency probe gets its own images (another seed): what it computes
    # must not be a prefix- or encoder-cache hit for the throughput run.
    probe = _prompts(replace(plan.workload, seed=plan.workload.seed + 1), vocab)
    timed = _prompts(plan.workload, vocab)
    accuracy = _accuracy_setup(plan, vocab)
    for dtype, layout in [(d, layout) for d in plan.dtypes for layout in plan.layouts]:
        kwargs = {**plan.engine_kwargs, "disable_hybrid_kv_cache_manager": layout == "plain"}
        llm = LLM(model=str(plan.model_dir), kv_cache_dtype=dtype, **kwargs)
        kv = llm.llm_engine.core.scheduler.kv
        row = {"kv_cache_dtype": dtype, "kv_layout": layout,
               "kv_groups": kv.groups.describe() if kv.groups.is_hybrid else "one group",
               "capacity_tokens": llm.get_metrics()["foveal:kv_cache_capacity_tokens"],
               "longest_request_tokens": kv.longest_request(
                   llm.llm_engine.config.scheduler.max_num_batched_tokens)}
        row["peak_running_before_preemption"] = _peak_running(llm, *probe)
        row.update(_throughput(llm, *timed))
        if accuracy is not None:
            row.update(accuracy.measure(llm))
        del llm
        gc.collect()
        row.update(_long_context_decode(plan, dtype, kwargs, vocab))
        plan.rows.append(row)
    return plan.rows


def _prompts(spec: WorkloadSpec, vocab: PromptVocab) -> tuple[list[dict], list[int]]:
    requests = build_workload(spec, vocab)
    return [r.to_prompt() for r in requests], [r.output_len for r in requests]


def _sampling(output_len: int):
    from foveal import SamplingParams

    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)


def _peak_running(llm, prompts: list[dict], output_lens: list[int]) -> int:
    """Most requests running in one step before the first preemption."""
    engine = llm.llm_engine
    ids = []
    for prompt, output_len in zip(prompts, output_lens):
        ids.append(engine.new_request_id())
        engine.add_request(ids[-1], prompt, _sampling(output_len))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.get_metrics()
        if stats["foveal:num_preemptions_total"] > 0:
            break
        peak = max(peak, int(stats["foveal:num_requests_running"]))
    engine.abort_request(ids)
    return peak


def _throughput(llm, prompts: list[dict], output_lens: list[int]) -> dict:
    names = ("num_preemptions_total", "prefix_cache_hits_total", "computed_tokens_total")
    metrics = llm.get_metrics()
    before = {name: metrics[f"foveal:{name}"] for name in names}
    start = time.perf_counter()
    outputs = llm.generate(prompts, [_sampling(n) for n in output_lens], use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    metrics = llm.get_metrics()
    delta = {name: metrics[f"foveal:{name}"] - before[name] for name in names}
    return {"output_tok_s": tokens / elapsed, "throughput_s": elapsed,
            "preemptions": delta["num_preemptions_total"],
            "prefix_cache_hit_tokens": delta["prefix_cache_hits_total"],
            "computed_tokens": delta["computed_tokens_total"]}


def _long_context_decode(plan: KVBenchPlan, dtype: str, engine_kwargs: dict,
                         vocab: PromptVocab) -> dict:
    """Median decode step time with --long-context prompt tokens in the cache."""
    from foveal import LLM

    if not plan.long_context:
        return {}
    rng = np.random.default_rng(1)
    prompt = {"prompt_token_ids": rng.choice(vocab.text_token_ids, plan.long_context).tolist()}
    kwargs = {**engine_kwargs, "kv_cache_memory_bytes": None,
              "max_model_len": plan.long_context + plan.decode_tokens + 16,
              "max_num_batched_tokens": 2048}
    llm = LLM(model=str(plan.model_dir), kv_cache_dtype=dtype, **kwargs)
    output = llm.generate(prompt, _sampling(plan.decode_tokens), use_tqdm=False)[0]
    metrics = output.metrics
    ms = (metrics.last_token_time - metrics.first_token_time) * 1000 / (plan.decode_tokens - 1)
    del llm
    gc.collect()
    return {"long_context_tokens": plan.long_context, "decode_ms_per_token": ms}


class _Accuracy:
    def __init__(self, plan: KVBenchPlan, prompts: list[dict]) -> None:
        from foveal import LLM
        from foveal.bench.kv_accuracy import reference_run

        self.prompts = prompts
        reference = LLM(model=str(plan.model_dir), kv_cache_dtype=plan.dtypes[0],
                        **plan.engine_kwargs)
        self.reference = reference_run(reference, prompts, plan.accuracy_tokens)

    def measure(self, llm) -> dict:
        from foveal.bench.kv_accuracy import agreement

        return agreement(llm, self.prompts, self.reference).as_dict()


def _accuracy_setup(plan: KVBenchPlan, vocab: PromptVocab) -> _Accuracy | None:
    if not plan.accuracy_prompts:
        return None
    spec = WorkloadSpec(num_prompts=plan.accuracy_prompts, images_per_prompt=1,
                        image_size=plan.workload.image_size, input_len=16,
                        output_len=plan.accuracy_tokens, output_len_range=0.0, seed=7)
    return _Accuracy(plan, [r.to_prompt() for r in build_workload(spec, vocab)])


def format_kv_table(rows: list[dict]) -> str:
    base = rows[0]
    lines = ["| KV dtype | layout | longest request | x | peak running | out tok/s | x | "
             "preemptions | decode ms/tok @ctx | x | top-1 agree | mean abs dlogit |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        decode = row.get("decode_ms_per_token")
        cells = [row["kv_cache_dtype"], row["kv_layout"], f"{row['longest_request_tokens']:,}",
                 f"{row['longest_request_tokens'] / base['longest_request_tokens']:.2f}",
                 str(row["peak_running_before_preemption"]), f"{row['output_tok_s']:.1f}",
                 f"{row['output_tok_s'] / base['output_tok_s']:.2f}", str(row["preemptions"]),
                 "-" if decode is None else f"{decode:.1f} @{row['long_context_tokens']}",
                 "-" if decode is None else f"{decode / base['decode_ms_per_token']:.2f}",
                 _fmt(row.get("top1_agreement"), "{:.4f}"),
                 _fmt(row.get("mean_abs_logit_diff"), "{:.4f}")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def run_bench_kv_cache(args: argparse.Namespace) -> int:
    kwargs = engine_kwargs(args)
    kwargs.pop("kv_cache_dtype")
    kwargs.pop("disable_hybrid_kv_cache_manager")
    layouts = tuple(args.kv_layouts.split(","))
    if set(layouts) - {"hybrid", "plain"}:
        raise SystemExit(f"--kv-layouts takes hybrid and plain, not {args.kv_layouts}")
    plan = KVBenchPlan(model_dir=model_dir_from_args(args), dtypes=tuple(args.kv_dtypes.split(",")),
                       workload=workload_spec_from_args(args), engine_kwargs=kwargs,
                       layouts=layouts,
                       long_context=args.long_context, decode_tokens=args.decode_tokens,
                       accuracy_prompts=args.accuracy_prompts,
                       accuracy_tokens=args.accuracy_tokens)
    rows = run_kv_bench(plan)
    print(format_kv_table(rows))
    if args.json:
        report = {"workload": workload_summary(plan.workload), "engine_kwargs": kwargs,
                  "rows": rows}
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


def register_kv_cache(bench_commands) -> None:
    parser = bench_commands.add_parser(
        "kv-cache", help="KV cache dtypes: capacity, concurrency, throughput, long-context "
                         "decode and accuracy", description=__doc__.split("\n\n")[1])
    add_model_source_args(parser)
    parser.add_argument("--kv-dtypes", default="float32,int8,fp8_e4m3,int4",
                        help="comma-separated; the first is the baseline of every ratio")
    parser.add_argument("--kv-layouts", default="hybrid",
                        help="hybrid and/or plain, comma-separated: sliding-window layers in "
                             "their own blocks, or every layer in every block")
    parser.add_argument("--long-context", type=int, default=8192,
                        help="prompt tokens for the decode timing (0: skip)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--accuracy-prompts", type=int, default=0,
                        help="1-image prompts for teacher-forced agreement (0: skip)")
    parser.add_argument("--accuracy-tokens", type=int, default=256,
                        help="decode positions per accuracy prompt")
    parser.add_argument("--json", metavar="OUT", help="write every number here")
    add_workload_args(parser)
    add_engine_args(parser)
    parser.set_defaults(func=run_bench_kv_cache)
