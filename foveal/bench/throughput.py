"""Offline throughput of Foveal on a synthetic workload, and the run that
compares it with the transformers baseline on the same weights."""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from foveal.bench.report import RequestRecord, ThroughputResult, best_baseline, speedup
from foveal.bench.workload import (BenchRequest, PromptVocab, WorkloadSpec, build_workload,
                                   warmup_request)
from foveal.errors import FovealError


@dataclass(frozen=True)
class ThroughputPlan:
    """What `foveal bench throughput` runs."""

    model_dir: Path
    workload: WorkloadSpec
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    hf_batch_sizes: tuple[int, ...] = ()  # empty: no baseline


def run_foveal(model_dir: Path, requests: Sequence[BenchRequest], warmup: BenchRequest,
               engine_kwargs: dict[str, Any], one_at_a_time: bool = False,
               system: str = "foveal") -> ThroughputResult:
    """Load the engine, warm it up, then time one `generate()` over every request (or,
    one_at_a_time, one `generate()` per request, each timed from its own submission)."""
    from foveal import LLM

    llm = LLM(model=str(model_dir), **engine_kwargs)
    try:
        llm.generate([warmup.to_prompt()], _sampling_params([warmup.output_len]), use_tqdm=False)
        start = time.perf_counter()
        batches = [[r] for r in requests] if one_at_a_time else [list(requests)]
        outputs, submitted = [], []
        for batch in batches:
            submitted_at = time.time()
            outputs += llm.generate([r.to_prompt() for r in batch],
                                    _sampling_params([r.output_len for r in batch]),
                                    use_tqdm=False)
            submitted += [submitted_at] * len(batch)
        wall = time.perf_counter() - start
        extra = {"cached_prompt_tokens": sum(output.num_cached_tokens for output in outputs)}
        if engine_kwargs.get("speculative_config"):  # counters include the warm-up request
            extra["spec_decode"] = {key.removeprefix("foveal:spec_decode_"): value
                                    for key, value in llm.get_metrics().items()
                                    if key.startswith("foveal:spec_decode_") and "{" not in key}
    finally:
        del llm
        _release_memory()
    records = [_record(output, request.output_len, submitted_at)
               for output, request, submitted_at in zip(outputs, requests, submitted)]
    return ThroughputResult(system, wall, records, extra=extra,
                            token_ids=[list(output.outputs[0].token_ids) for output in outputs])


def _sampling_params(output_lens: Sequence[int]) -> list:
    from foveal import SamplingParams

    return [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in output_lens]


def _record(output, requested_len: int, submitted_at: float) -> RequestRecord:
    """Timing of one finished request; it must have produced every token asked for.

    Latencies count from `submitted_at`, when generate() got every request (the
    engine stamps arrival_time only after a request's images are processed), so
    preprocessing counts as it does in the baseline, where all requests arrive
    at the start too.
    """
    if output.error:
        raise FovealError(f"request {output.request_id} failed: {output.error}")
    generated = len(output.outputs[0].token_ids)
    if generated != requested_len:
        raise FovealError(f"request {output.request_id} produced {generated} tokens where "
                          f"{requested_len} were asked for (finish reason "
                          f"{output.outputs[0].finish_reason!r}); is max_model_len too small?")
    metrics = output.metrics
    return RequestRecord(prompt_len=len(output.prompt_token_ids), output_len=generated,
                         ttft_s=metrics.first_token_time - submitted_at,
                         finished_s=metrics.finished_time - submitted_at)


def run_hf(model_dir: Path, requests: Sequence[BenchRequest], warmup: BenchRequest,
           batch_sizes: Sequence[int], engine_kwargs: dict[str, Any]) -> list[ThroughputResult]:
    """The transformers baseline at each static batch size, on Foveal's device and dtype."""
    from foveal.bench.hf_baseline import HFBaseline
    from foveal.engine_args import EngineArgs
    from foveal.worker.device import torch_dtype

    config = EngineArgs.from_kwargs(str(model_dir), **engine_kwargs).create_engine_config()
    baseline = HFBaseline(model_dir, config.device, torch_dtype(config.dtype),
                          config.multimodal.mm_processor_kwargs, config.scheduler.max_model_len)
    try:
        baseline.warmup(warmup)
        return [baseline.run(requests, batch_size) for batch_size in batch_sizes]
    finally:
        del baseline
        _release_memory()


def _release_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_throughput(plan: ThroughputPlan) -> dict:
    """Foveal, then (optionally) the baseline; returns every summary and the speedup."""
    vocab = PromptVocab.from_model_dir(plan.model_dir)
    requests = build_workload(plan.workload, vocab)
    warmup = warmup_request(vocab)
    results = [run_foveal(plan.model_dir, requests, warmup, plan.engine_kwargs)]
    if plan.hf_batch_sizes:
        results += run_hf(plan.model_dir, requests, warmup, plan.hf_batch_sizes,
                          plan.engine_kwargs)
    summaries = [result.summary() for result in results]
    baseline = best_baseline(summaries)
    return {"results": summaries,
            "speedup_vs_hf": speedup(summaries[0], baseline) if baseline else None,
            "best_hf_batch_size": baseline["batch_size"] if baseline else None}
