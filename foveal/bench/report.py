"""Benchmark results: per-request records, their summary statistics, the table.

Every system under test (Foveal, the transformers baseline at each batch size)
reports the same `RequestRecord`s, so every number is computed one way.
"""
from __future__ import annotations

import json
import math
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence


@dataclass(frozen=True)
class RequestRecord:
    prompt_len: int  # prompt tokens after placeholder expansion (visual tokens included)
    output_len: int  # useful output tokens: what the request asked for
    # Offline runs: every request arrives when the timed run starts.
    ttft_s: float  # first token time - arrival time
    finished_s: float  # last useful token time - arrival time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for one-token outputs."""
        if self.output_len < 2:
            return None
        return (self.finished_s - self.ttft_s) / (self.output_len - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks; NaN if empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


@dataclass
class ThroughputResult:
    system: str  # "foveal" or "hf"
    wall_s: float
    records: list[RequestRecord]
    batch_size: int | None = None  # static batch size (the HF baseline only)
    extra: dict = field(default_factory=dict)  # more summary entries
    token_ids: list[list[int]] = field(default_factory=list)  # each request's output, if kept

    def summary(self) -> dict:
        prompt_tokens = sum(r.prompt_len for r in self.records)
        output_tokens = sum(r.output_len for r in self.records)
        ttfts = [r.ttft_s for r in self.records]
        tpots = [r.tpot_s for r in self.records if r.tpot_s is not None]
        wall = self.wall_s
        return {
            "system": self.system, "batch_size": self.batch_size,
            "num_requests": len(self.records), "wall_s": wall,
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "requests_per_s": len(self.records) / wall,
            "output_tokens_per_s": output_tokens / wall,
            "total_tokens_per_s": (prompt_tokens + output_tokens) / wall,
            "ttft_median_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "tpot_median_s": percentile(tpots, 50), "tpot_p99_s": percentile(tpots, 99),
            **self.extra,
        }


_COLUMNS = (  # header, summary key, format
    ("system", "label", "{}"),
    ("req/s", "requests_per_s", "{:.2f}"),
    ("out tok/s", "output_tokens_per_s", "{:.1f}"),
    ("total tok/s", "total_tokens_per_s", "{:.1f}"),
    ("TTFT med ms", "ttft_median_s", "ms"),
    ("TTFT p99 ms", "ttft_p99_s", "ms"),
    ("TPOT med ms", "tpot_median_s", "ms"),
    ("TPOT p99 ms", "tpot_p99_s", "ms"),
    ("wall s", "wall_s", "{:.2f}"),
)


def _label(summary: dict) -> str:
    if summary["batch_size"] is None:
        return summary["system"]
    return f"{summary['system']} (batch {summary['batch_size']})"


def _cell(value, fmt: str) -> str:
    if fmt == "ms":
        return "-" if math.isnan(value) else f"{value * 1000:.1f}"
    return fmt.format(value)


def format_table(summaries: Sequence[dict]) -> str:
    """One row per system / batch size, columns aligned."""
    rows = [[header for header, _, _ in _COLUMNS]]
    for summary in summaries:
        values = {**summary, "label": _label(summary)}
        rows.append([_cell(values[key], fmt) for _, key, fmt in _COLUMNS])
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def best_baseline(summaries: Sequence[dict]) -> dict | None:
    """The HF row with the highest output tokens/s (the baseline to beat)."""
    baselines = [s for s in summaries if s["system"] == "hf"]
    return max(baselines, key=lambda s: s["output_tokens_per_s"], default=None)


def speedup(foveal: dict, baseline: dict) -> float:
    """Foveal's output tokens/s over the baseline's."""
    return foveal["output_tokens_per_s"] / baseline["output_tokens_per_s"]


def write_json_report(path: Path, body: dict) -> None:
    """`body` after the command line that ran, as indented JSON (parents made), with the
    machine it ran on (CPU features, allocator, ...) unless the body has it already."""
    from foveal.bench.machine import machine_info

    report = {"command_line": shlex.join(["foveal", *sys.argv[1:]]), **body}
    report.setdefault("machine", machine_info(load=False))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {path}")
