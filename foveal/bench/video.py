"""`foveal bench video`: the speed side of the video downsampling dial.

A seeded test clip (moving shapes over a drifting gradient, so every frame
differs) is written with PyAV; then, for each (sampling fps, per-frame
max_pixels) point, one request with that clip goes through `LLM.generate`
(greedy, EOS ignored, fixed output length) and the point reports frames
sampled, visual tokens (the planner's `mm_plan`), TTFT, decode tok/s and
end-to-end seconds, medians over the repeats.

Nothing is served from a cache: prefix caching is off, and every (point,
repeat) request gets its own clip (seed + its index), so its mm_hash is new to
the encoder cache even where two points sample the same frames at the same
resolution (fps 0.5 and 1 both give the 4-frame minimum on a 4 s clip); the
run checks the engine's encoder-cache hit counter stays at zero and fails
otherwise.

TTFT counts from the engine's arrival_time, stamped after the clip is decoded
and processed; that preprocessing is reported on its own, and end-to-end
seconds cover both.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from foveal.bench.clip import ClipSpec, write_clip
from foveal.bench.model_source import add_model_source_args, model_dir_from_args
from foveal.bench.report import write_json_report
from foveal.bench.workload import PromptVocab, parse_image_size
from foveal.entrypoints.cli_args import add_engine_args, engine_kwargs
from foveal.errors import CheckpointError, ConfigError, FovealError

_WARMUP_CLIP_SIDE = 64
_PROMPT_TEXT_TOKENS = 8


def positive_list(parse: Callable[[str], Any], what: str) -> Callable[[str], tuple]:
    def parse_list(value: str) -> tuple:
        try:
            items = tuple(parse(item) for item in value.split(",") if item.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {what}, got {value!r}") from None
        if not items or min(items) <= 0:
            raise argparse.ArgumentTypeError(f"expected positive {what}, got {value!r}")
        return tuple(dict.fromkeys(items))

    return parse_list


parse_fps_list = positive_list(float, "frame rates")
parse_pixels_list = positive_list(int, "pixel counts")


@dataclass(frozen=True)
class VideoBenchPlan:
    """What `foveal bench video` runs: every fps x max_pixels point, `repeats` times."""

    model_dir: Path
    clip: ClipSpec
    fps: tuple[float, ...]
    max_pixels: tuple[int, ...]
    output_len: int = 16
    repeats: int = 2
    engine_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.output_len < 1 or self.repeats < 1:
            raise ConfigError(f"--output-len and --repeats must be >= 1, got "
                              f"{self.output_len} and {self.repeats}")

    def points(self) -> list[tuple[float, int]]:
        return [(fps, pixels) for fps in self.fps for pixels in self.max_pixels]


def run_video_bench(plan: VideoBenchPlan) -> list[dict]:
    """One row per point, in `plan.points()` order."""
    from foveal import LLM

    kwargs = {**plan.engine_kwargs, "enable_prefix_caching": False}
    kwargs["limit_mm_per_prompt"] = {"video": 1, **kwargs.get("limit_mm_per_prompt", {})}
    prompt_ids, points = _prompt_token_ids(plan.model_dir), plan.points()
    samples: dict[tuple[float, int], list[dict]] = {point: [] for point in points}
    with tempfile.TemporaryDirectory(prefix="foveal-bench-video-") as folder:
        llm = LLM(model=str(plan.model_dir), **kwargs)
        try:
            warmup = write_clip(_warmup_clip(plan.clip), Path(folder) / "warmup.mp4")
            _measure(llm, _prompt(prompt_ids, warmup, *points[0]), min(2, plan.output_len))
            for repeat in range(plan.repeats):  # rounds over every point: drift spreads evenly
                for index, point in enumerate(points):
                    seed = plan.clip.seed + repeat * len(points) + index
                    clip = write_clip(replace(plan.clip, seed=seed), Path(folder) / "clip.mp4")
                    sample = _measure(llm, _prompt(prompt_ids, clip, *point), plan.output_len)
                    samples[point].append(sample)
                    print(f"fps {point[0]:g} max_pixels {point[1]} repeat {repeat}: "
                          f"{sample['visual_tokens']} visual tokens, "
                          f"TTFT {sample['ttft_s'] * 1000:.0f} ms", flush=True)
        finally:
            llm.shutdown()
            del llm
            gc.collect()
    return [_summary(point, runs) for point, runs in samples.items()]


def _warmup_clip(clip: ClipSpec) -> ClipSpec:
    """Short and small: its frames match no measured clip's, so it warms no cache entry."""
    return replace(clip, seconds=min(clip.seconds, 2.0), width=_WARMUP_CLIP_SIDE,
                   height=_WARMUP_CLIP_SIDE)


def _prompt_token_ids(model_dir: Path) -> list[int]:
    """<|vision_start|><|video_pad|><|vision_end|> then a few ordinary tokens."""
    from foveal.tokenizer import Tokenizer

    vocab = PromptVocab.from_model_dir(model_dir)
    video_pad_id = Tokenizer.from_pretrained(model_dir).token_to_id("<|video_pad|>")
    if video_pad_id is None:
        raise CheckpointError("the tokenizer has no <|video_pad|> token; "
                              "is this a Qwen2-VL checkpoint?")
    video_span = [video_pad_id if t == vocab.image_token_id else t for t in vocab.image_prompt_ids]
    return [*video_span, *vocab.text_token_ids[:_PROMPT_TEXT_TOKENS]]


def _prompt(token_ids: list[int], clip: Path, fps: float, max_pixels: int) -> dict:
    return {"prompt_token_ids": list(token_ids), "multi_modal_data": {"video": str(clip)},
            "mm_processor_kwargs": {"fps": fps, "video_max_pixels": max_pixels}}


def _measure(llm, prompt: dict, output_len: int) -> dict:
    """One request, alone in the engine; fails if it was served from any cache."""
    from foveal import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    hits_before = llm.get_metrics().get("foveal:encoder_cache_hits_total", 0)
    submitted, start = time.time(), time.perf_counter()
    [output] = llm.generate([prompt], params, use_tqdm=False)
    e2e = time.perf_counter() - start
    encoder_hits = llm.get_metrics().get("foveal:encoder_cache_hits_total", 0) - hits_before
    generated = len(output.outputs[0].token_ids) if output.outputs else 0
    if output.error or generated != output_len:
        raise FovealError(f"the video request produced {generated} of {output_len} tokens "
                          f"({output.error or 'is max_model_len too small?'})")
    if encoder_hits or output.num_cached_tokens:
        raise FovealError(f"a measured request was served from a cache ({encoder_hits} encoder "
                          f"hits, {output.num_cached_tokens} prefix tokens); the timing is void")
    metrics, [item] = output.metrics, output.mm_plan
    decode_s = metrics.last_token_time - metrics.first_token_time
    return {"frames": item.num_frames, "visual_tokens": item.num_tokens,
            "prompt_tokens": len(output.prompt_token_ids),
            "preprocess_s": metrics.arrival_time - submitted,
            "ttft_s": metrics.first_token_time - metrics.arrival_time,
            "decode_tok_s": (generated - 1) / decode_s if generated > 1 and decode_s > 0 else None,
            "e2e_s": e2e}


def _summary(point: tuple[float, int], runs: list[dict]) -> dict:
    def median(key: str) -> float | None:
        values = [run[key] for run in runs if run[key] is not None]
        return statistics.median(values) if values else None

    fps, max_pixels = point
    return {"fps": fps, "max_pixels": max_pixels, "frames": runs[0]["frames"],
            "visual_tokens": runs[0]["visual_tokens"], "prompt_tokens": runs[0]["prompt_tokens"],
            **{key: median(key) for key in ("ttft_s", "decode_tok_s", "e2e_s", "preprocess_s")},
            "ttft_runs_s": [run["ttft_s"] for run in runs]}


_COLUMNS = (  # header, row key, format
    ("fps", "fps", "{:g}"), ("max_pixels", "max_pixels", "{}"), ("frames", "frames", "{}"),
    ("visual tokens", "visual_tokens", "{}"), ("TTFT ms", "ttft_s", "ms"),
    ("decode tok/s", "decode_tok_s", "{:.1f}"), ("E2E s", "e2e_s", "{:.2f}"),
    ("preprocess s", "preprocess_s", "{:.2f}"),
)


def format_video_table(rows: list[dict]) -> str:
    """A Markdown table, one line per point."""
    def cell(value, fmt: str) -> str:
        if value is None:
            return "-"
        return f"{value * 1000:.0f}" if fmt == "ms" else fmt.format(value)

    lines = ["| " + " | ".join(header for header, _, _ in _COLUMNS) + " |",
             "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(cell(row[key], fmt) for _, key, fmt in _COLUMNS) + " |"
              for row in rows]
    return "\n".join(lines)


def write_plot(rows: list[dict], path: Path) -> None:
    """Two panels: visual tokens vs fps per max_pixels; TTFT vs visual tokens."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    figure = Figure(figsize=(10, 4), layout="constrained")
    tokens_axis, ttft_axis = figure.subplots(1, 2)
    for max_pixels in dict.fromkeys(row["max_pixels"] for row in rows):
        line = [row for row in rows if row["max_pixels"] == max_pixels]
        label = f"max_pixels {max_pixels}"
        tokens_axis.plot([r["fps"] for r in line], [r["visual_tokens"] for r in line], "o-",
                         label=label)
        ttft_axis.plot([r["visual_tokens"] for r in line], [r["ttft_s"] for r in line], "o",
                       label=label)
    tokens_axis.set(xlabel="sampling fps", ylabel="visual tokens", title="Visual tokens vs fps")
    ttft_axis.set(xlabel="visual tokens", ylabel="TTFT (s)", title="TTFT vs visual tokens")
    for axis in (tokens_axis, ttft_axis):
        axis.grid(alpha=0.3)
        axis.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def _clip_size(value: str) -> tuple[int, int]:
    try:
        return parse_image_size(value)
    except ConfigError:
        raise argparse.ArgumentTypeError(
            f"expected WIDTHxHEIGHT such as 640x360, got {value!r}") from None


def run_bench_video(args: argparse.Namespace) -> int:
    width, height = args.clip_size
    plan = VideoBenchPlan(model_dir=model_dir_from_args(args),
                          clip=ClipSpec(args.clip_seconds, width, height, args.clip_fps, args.seed),
                          fps=args.fps, max_pixels=args.max_pixels, output_len=args.output_len,
                          repeats=args.repeats, engine_kwargs=engine_kwargs(args))
    print(f"model: {plan.model_dir}; clip: {plan.clip}", flush=True)
    rows = run_video_bench(plan)
    print(format_video_table(rows))
    if args.json:
        write_json_report(Path(args.json), {
            "model_dir": str(plan.model_dir), "clip": asdict(plan.clip),
            "output_len": plan.output_len, "repeats": plan.repeats,
            "engine_kwargs": {**plan.engine_kwargs, "enable_prefix_caching": False},
            "points": rows})
    if args.plot:
        write_plot(rows, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


def register_video(bench_commands) -> None:
    parser = bench_commands.add_parser(
        "video", help="video downsampling dial: visual tokens and TTFT per fps x max_pixels",
        description=__doc__.split("\n\n")[1])
    add_model_source_args(parser)
    clip = parser.add_argument_group("test clip (seeded by --seed)")
    clip.add_argument("--clip-seconds", type=float, default=10.0)
    clip.add_argument("--clip-size", type=_clip_size, default=(640, 360), help="WIDTHxHEIGHT")
    clip.add_argument("--clip-fps", type=int, default=24, help="frame rate of the clip itself")
    grid = parser.add_argument_group("grid (every fps x every max_pixels)")
    grid.add_argument("--fps", type=parse_fps_list, default=(0.5, 1.0, 2.0),
                      help="sampling frame rates, comma-separated")
    grid.add_argument("--max-pixels", type=parse_pixels_list, default=(50176, 100352, 200704),
                      help="per-frame pixel caps (video_max_pixels), comma-separated")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="requests per point (median)")
    parser.add_argument("--json", metavar="OUT", help="write every number here")
    parser.add_argument("--plot", metavar="PNG", help="write the two-panel plot (needs matplotlib)")
    add_engine_args(parser)
    parser.set_defaults(func=run_bench_video)
