"""`foveal bench sweep`: the quality/speed dial of a VLM on the held-out eval split.

Each point of each series runs the eval samples of the synthetic visual tasks
(foveal.demo_model.tasks, the first 6 x --num-per-task indices) through
`LLM.chat`, greedy with at most --max-tokens tokens, and reports exact-match
accuracy (stripped text == answer) overall and per task, the mean visual
tokens per request (the planner's `mm_plan`), median TTFT and decode tok/s.

Series (--series, default all):
  resolution   image tasks; per-request mm_processor_kwargs max_pixels, or none ("full")
  detail       image tasks; every image part sent with detail low / auto / high
  frames       motion; the 8-frame clip cut to N evenly spaced frames here (not by
               the processor: its min_frames would refuse 2), with the clip's fps
               scaled by N / 8 so the processor's sampler keeps them all and the
               clip keeps its duration; 1 frame is the first frame
  budget       all tasks; per-request mm_processor_kwargs max_visual_tokens
  kv_cache     all tasks; one LLM per kv_cache_dtype
  weights      all tasks; the checkpoint's weights vs --quantization int8
  speculative  all tasks; n-gram drafts vs none, with the draft acceptance rate

One LLM per engine configuration (kv_cache_dtype, quantization, speculative_config), shared
by every request-level point that uses it; requests run one at a time, so TTFT
is the request's own prefill. Nothing is served from a cache: prefix caching
is off, and each point's images (and its clip's first frame) carry the point's
index in the lowest bit of the red channel of the first 8 pixels of row 0, so
their mm_hash is new to the encoder cache even where two points process a
sample alike (detail auto and high without a budget); the run checks the
encoder-cache hit counter stays at zero and fails otherwise. TTFT counts from
the engine's arrival_time, stamped after the media are processed.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from foveal.bench.machine import machine_info
from foveal.bench.model_source import add_model_source_args, model_dir_from_args
from foveal.bench.report import write_json_report
from foveal.bench.video import parse_pixels_list, positive_list
from foveal.demo_model import DEMO_MODEL_DIR
from foveal.demo_model.tasks import TASKS, make_sample
from foveal.entrypoints.cli_args import add_engine_args, engine_kwargs
from foveal.errors import CheckpointError, ConfigError, FovealError, InvalidRequestError

IMAGE_TASKS = tuple(task for task in TASKS if task != "motion")
_MARK_BITS = 8  # pixels of row 0 that carry a point's index: 255 points at most
_WARMUP_INDICES = (4, 5)  # a two-image sample and a clip, from another split

parse_budget_list = positive_list(int, "visual-token budgets")
parse_frames_list = positive_list(int, "frame counts")


@dataclass(frozen=True)
class SweepPoint:
    """One setting of one dial: what changes in the engine and in each request."""

    series: str
    label: str  # tick label: "full", "50176", "low", "4", "int8", "ngram"
    tasks: tuple[str, ...]
    engine: dict = field(default_factory=dict)  # engine kwargs over the base ones
    detail: str = "auto"
    mm_processor_kwargs: dict = field(default_factory=dict)
    num_frames: int | None = None  # keep this many frames of a clip (None: all)


@dataclass(frozen=True)
class SweepPlan:
    model_dir: Path
    series: tuple[str, ...] = ()  # empty: every series
    num_per_task: int = 50
    max_tokens: int = 8
    max_pixels: tuple[int, ...] = (112896, 50176, 25088, 12544, 6272, 3136)
    budgets: tuple[int, ...] = (128, 64, 32, 16)
    frames: tuple[int, ...] = (8, 4, 2, 1)
    kv_dtypes: tuple[str, ...] = ("auto", "int8", "fp8_e4m3", "int4")
    num_speculative_tokens: int = 3
    eagle_head: str | None = None  # an EAGLE-3 head for the target: one more speculative point
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = [name for name in self.series if name not in SERIES]
        if unknown:
            raise ConfigError(f"unknown series {unknown}; choose from {list(SERIES)} (--series)")
        for name in ("num_per_task", "max_tokens", "num_speculative_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, "
                                  f"got {getattr(self, name)}")
        if not self.kv_dtypes:
            raise ConfigError("--kv-dtypes is empty; give at least one KV cache dtype")

    def points(self) -> list[SweepPoint]:
        points = [point for name in self.series or SERIES for point in SERIES[name](self)]
        if len(points) >= 2 ** _MARK_BITS:
            raise ConfigError(f"{len(points)} points; a sweep runs at most "
                              f"{2 ** _MARK_BITS - 1} (fewer series or dial values)")
        return points


def _resolution(plan: SweepPlan) -> list[SweepPoint]:
    return [SweepPoint("resolution", "full", IMAGE_TASKS)] + [
        SweepPoint("resolution", str(pixels), IMAGE_TASKS,
                   mm_processor_kwargs={"max_pixels": pixels})
        for pixels in plan.max_pixels]


def _detail(plan: SweepPlan) -> list[SweepPoint]:
    return [SweepPoint("detail", detail, IMAGE_TASKS, detail=detail)
            for detail in ("low", "auto", "high")]


def _frames(plan: SweepPlan) -> list[SweepPoint]:
    return [SweepPoint("frames", str(count), ("motion",), num_frames=count)
            for count in plan.frames]


def _budget(plan: SweepPlan) -> list[SweepPoint]:
    return [SweepPoint("budget", str(budget), TASKS,
                       mm_processor_kwargs={"max_visual_tokens": budget})
            for budget in plan.budgets]


def _kv_cache(plan: SweepPlan) -> list[SweepPoint]:
    return [SweepPoint("kv_cache", dtype, TASKS, engine={"kv_cache_dtype": dtype})
            for dtype in plan.kv_dtypes]


def _weights(plan: SweepPlan) -> list[SweepPoint]:
    return [SweepPoint("weights", name, TASKS, engine={"quantization": method})
            for name, method in (("as stored", None), ("int8", "int8"))]


def _speculative(plan: SweepPlan) -> list[SweepPoint]:
    k = plan.num_speculative_tokens
    points = [SweepPoint("speculative", "none", TASKS, engine={"speculative_config": None}),
              SweepPoint("speculative", f"ngram k={k}", TASKS, engine={"speculative_config": {
                  "method": "ngram", "num_speculative_tokens": k}})]
    if plan.eagle_head:
        points.append(SweepPoint("speculative", f"eagle3 k={k}", TASKS, engine={
            "speculative_config": {"method": "eagle3", "num_speculative_tokens": k,
                                   "model": str(plan.eagle_head)}}))
    return points


SERIES: dict[str, Callable[[SweepPlan], list[SweepPoint]]] = {
    "resolution": _resolution, "detail": _detail, "frames": _frames, "budget": _budget,
    "kv_cache": _kv_cache, "weights": _weights, "speculative": _speculative,
}


def score(text: str, answer: str) -> bool:
    """Exact match after stripping whitespace."""
    return text.strip() == answer


def eval_samples(num_per_task: int) -> list:
    """The first 6 x num_per_task eval samples: num_per_task of each task."""
    return [make_sample("eval", index) for index in range(len(TASKS) * num_per_task)]


def marked(pixels: Image.Image | np.ndarray, salt: int) -> Image.Image | np.ndarray:
    """A copy whose first 8 pixels of row 0 carry `salt` in their red channel's
    lowest bit: new content for the caches, the same picture for the model."""
    array = np.array(pixels, dtype=np.uint8)  # (H, W, 3), a copy
    bits = np.array([(salt >> bit) & 1 for bit in range(_MARK_BITS)], dtype=np.uint8)
    array[0, :_MARK_BITS, 0] = (array[0, :_MARK_BITS, 0] & 0xFE) | bits
    return Image.fromarray(array) if isinstance(pixels, Image.Image) else array


def point_sample(sample, point: SweepPoint, salt: int):
    """The sample as `point` sends it: marked media, the clip cut to its frame count."""
    from foveal.multimodal.media.video import sample_indices

    images = [marked(image, salt) for image in sample.images]
    if sample.video is None:
        return replace(sample, images=images)
    count = min(point.num_frames or len(sample.video), len(sample.video))
    frames = [sample.video[i] for i in sample_indices(len(sample.video), count)]
    fps = sample.video_fps * count / len(sample.video)  # same duration: the sampler keeps all
    return replace(sample, images=images, video=[marked(frames[0], salt), *frames[1:]],
                   video_fps=fps)


def summarize(point: SweepPoint, records: list[dict], spec: dict | None = None) -> dict:
    """One row: accuracy overall and per task, visual tokens, TTFT, decode tok/s."""
    def mean(values: list) -> float | None:
        return sum(values) / len(values) if values else None

    decoding = [r for r in records if r["generated"] > 1]
    decode_s = sum(r["decode_s"] for r in decoding)
    return {"series": point.series, "label": point.label, "engine": point.engine,
            "detail": point.detail, "mm_processor_kwargs": point.mm_processor_kwargs,
            "num_frames": point.num_frames, "num_samples": len(records),
            "accuracy": mean([r["correct"] for r in records]),
            "task_accuracy": {task: mean([r["correct"] for r in records if r["task"] == task])
                              for task in point.tasks if any(r["task"] == task for r in records)},
            "visual_tokens": mean([r["visual_tokens"] for r in records]),
            "frames": mean([r["frames"] for r in records if r["frames"] is not None]),
            "ttft_median_s": statistics.median(r["ttft_s"] for r in records) if records else None,
            "decode_tok_s": (sum(r["generated"] - 1 for r in decoding) / decode_s
                             if decode_s > 0 else None),
            "spec_decode": spec}


def run_sweep(plan: SweepPlan) -> list[dict]:
    """One row per point, in `plan.points()` order; one LLM per engine configuration."""
    from foveal.engine_args import EngineArgs

    points, samples = plan.points(), eval_samples(plan.num_per_task)
    groups = _engine_groups(base_engine_kwargs(plan.engine_kwargs), points)
    for kwargs, _ in groups:  # a bad option fails now, not after an hour of other points
        EngineArgs.from_kwargs(str(plan.model_dir), **kwargs).create_engine_config()
    rows: list[dict | None] = [None] * len(points)
    for kwargs, indices in groups:
        llm = _load(plan.model_dir, kwargs)
        try:
            _warm_up(llm, plan.max_tokens)
            for index in indices:
                rows[index] = _run_point(llm, points[index], samples, index + 1, plan.max_tokens)
                _print_progress(rows[index])
        finally:
            llm.shutdown()
            del llm
            gc.collect()
    return rows


def base_engine_kwargs(engine: dict[str, Any]) -> dict[str, Any]:
    return {**engine, "enable_prefix_caching": False}


def _engine_groups(base: dict, points: list[SweepPoint]) -> list[tuple[dict, list[int]]]:
    """Point indices per distinct engine configuration, in first-use order."""
    groups: dict[str, tuple[dict, list[int]]] = {}
    for index, point in enumerate(points):
        kwargs = {**base, **point.engine}
        key = json.dumps(kwargs, sort_keys=True, default=str)
        groups.setdefault(key, (kwargs, []))[1].append(index)
    return list(groups.values())


def _load(model_dir: Path, kwargs: dict):
    from foveal import LLM

    print(f"loading {model_dir} (kv_cache_dtype {kwargs.get('kv_cache_dtype')}, "
          f"quantization {kwargs.get('quantization')}, "
          f"speculative_config {kwargs.get('speculative_config')})", flush=True)
    return LLM(model=str(model_dir), **kwargs)


def _sampling(max_tokens: int):
    from foveal import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def _warm_up(llm, max_tokens: int) -> None:
    """Samples of another split: warm kernels, no cache entry a measured request could hit."""
    for index in _WARMUP_INDICES:
        llm.chat(make_sample("sweep-warmup", index).messages(), _sampling(max_tokens),
                 use_tqdm=False)


def _run_point(llm, point: SweepPoint, samples: list, salt: int, max_tokens: int) -> dict:
    speculative = bool(llm.engine_args.speculative_config)
    spec_before = _spec_counters(llm)
    records = []
    for sample in samples:
        if sample.task not in point.tasks:
            continue
        try:
            record = _measure(llm, point_sample(sample, point, salt), point, max_tokens)
        except InvalidRequestError as error:
            raise ConfigError(f"series {point.series} point {point.label}: sample "
                              f"{sample.uid} ({sample.task}) was refused: {error}") from error
        records.append({**record, "task": sample.task,
                        "correct": score(record["text"], sample.answer)})
    spec = _spec_delta(spec_before, _spec_counters(llm)) if speculative else None
    return summarize(point, records, spec)


def _measure(llm, sample, point: SweepPoint, max_tokens: int) -> dict:
    """One request, alone in the engine; fails if it was served from any cache."""
    hits_before = llm.get_metrics().get("foveal:encoder_cache_hits_total", 0)
    [output] = llm.chat(sample.messages(point.detail), _sampling(max_tokens), use_tqdm=False,
                        mm_processor_kwargs=point.mm_processor_kwargs or None)
    encoder_hits = llm.get_metrics().get("foveal:encoder_cache_hits_total", 0) - hits_before
    if output.error:
        raise FovealError(f"sample {sample.uid} failed: {output.error}")
    if encoder_hits or output.num_cached_tokens:
        raise FovealError(f"sample {sample.uid} was served from a cache ({encoder_hits} encoder "
                          f"hits, {output.num_cached_tokens} prefix tokens); the timing is void")
    completion, metrics = output.outputs[0], output.metrics
    videos = [item for item in output.mm_plan if item.modality == "video"]
    return {"text": completion.text, "generated": len(completion.token_ids),
            "visual_tokens": sum(item.num_tokens for item in output.mm_plan),
            "frames": videos[0].num_frames if videos else None,
            "ttft_s": metrics.first_token_time - metrics.arrival_time,
            "decode_s": metrics.last_token_time - metrics.first_token_time}


def _spec_counters(llm) -> tuple[float, float]:
    metrics = llm.get_metrics()
    return (metrics.get("foveal:spec_decode_num_draft_tokens_total", 0),
            metrics.get("foveal:spec_decode_num_accepted_tokens_total", 0))


def _spec_delta(before: tuple[float, float], after: tuple[float, float]) -> dict:
    drafted, accepted = after[0] - before[0], after[1] - before[1]
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None}


def _print_progress(row: dict) -> None:
    if not row["num_samples"]:
        print(f"{row['series']} {row['label']}: no samples", flush=True)
        return
    print(f"{row['series']} {row['label']}: accuracy {row['accuracy']:.3f} over "
          f"{row['num_samples']} samples, {row['visual_tokens']:.1f} visual tokens, "
          f"TTFT {row['ttft_median_s'] * 1000:.1f} ms", flush=True)


def run_bench_sweep(args: argparse.Namespace) -> int:
    from foveal.bench.sweep_report import format_sweep_table, write_sweep_plot

    model_dir = model_dir_from_args(args)
    if not (model_dir / "config.json").is_file():
        raise CheckpointError(f"{model_dir} has no config.json; train the demo model "
                              "(foveal train-demo) or pass --model DIR")
    plan = SweepPlan(model_dir=model_dir, series=args.series, num_per_task=args.num_per_task,
                     max_tokens=args.max_tokens, max_pixels=args.max_pixels, budgets=args.budgets,
                     frames=args.frames, kv_dtypes=args.kv_dtypes,
                     num_speculative_tokens=args.num_speculative_tokens,
                     eagle_head=args.eagle_head, engine_kwargs=engine_kwargs(args))
    machine = machine_info()
    print(f"model: {model_dir}; {len(plan.points())} points; machine: {machine['cpu_model']}",
          flush=True)
    rows = run_sweep(plan)
    print(format_sweep_table(rows))
    if args.output:
        write_json_report(Path(args.output), {
            "model_dir": str(model_dir), "machine": machine, "split": "eval",
            "num_per_task": plan.num_per_task, "max_tokens": plan.max_tokens,
            "engine_kwargs": base_engine_kwargs(plan.engine_kwargs),
            "series": list(dict.fromkeys(row["series"] for row in rows)), "points": rows})
    if args.plot:
        write_sweep_plot(rows, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


def _name_list(value: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(item.strip() for item in value.split(",") if item.strip()))


def register_sweep(bench_commands) -> None:
    parser = bench_commands.add_parser(
        "sweep", help="quality/speed dial: eval accuracy, visual tokens and latency per setting",
        description="\n\n".join(__doc__.split("\n\n")[1:3]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_source_args(parser, default_model=DEMO_MODEL_DIR)
    parser.add_argument("--series", type=_name_list, default=(),
                        help=f"comma-separated, from {','.join(SERIES)} (default: all)")
    parser.add_argument("--num-per-task", type=int, default=50,
                        help="eval samples per task (the first 6 x N eval indices)")
    parser.add_argument("--max-tokens", type=int, default=8, help="generated tokens at most")
    dials = parser.add_argument_group("dial values")
    dials.add_argument("--max-pixels", type=parse_pixels_list,
                       default=SweepPlan.max_pixels, help="resolution series, comma-separated")
    dials.add_argument("--budgets", type=parse_budget_list, default=SweepPlan.budgets,
                       help="budget series: max_visual_tokens values, comma-separated")
    dials.add_argument("--frames", type=parse_frames_list, default=SweepPlan.frames,
                       help="frames series: frames kept of the 8-frame clip, comma-separated")
    dials.add_argument("--kv-dtypes", type=_name_list, default=SweepPlan.kv_dtypes,
                       help="kv_cache series, comma-separated")
    dials.add_argument("--num-speculative-tokens", type=int, default=3,
                       help="speculative series: draft length")
    dials.add_argument("--eagle-head", metavar="DIR",
                       help="speculative series: also an EAGLE-3 head (foveal train-eagle)")
    parser.add_argument("--output", metavar="JSON", help="write every number here")
    parser.add_argument("--plot", metavar="PNG", help="one panel per series (needs matplotlib)")
    add_engine_args(parser)
    parser.set_defaults(func=run_bench_sweep)
