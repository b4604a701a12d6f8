"""`foveal bench sweep`'s outputs: the Markdown table (for docs/benchmarks.md)
and the plot, one panel per series."""
from __future__ import annotations

from pathlib import Path

from foveal.demo_model.tasks import TASKS


def _cell(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def format_sweep_table(rows: list[dict]) -> str:
    """One line per point; a task the point does not apply to shows "-"."""
    header = ["series", "point", "visual tokens", "accuracy", *TASKS, "TTFT ms", "tok/s",
              "draft accept"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        ttft, spec = row["ttft_median_s"], row["spec_decode"] or {}
        cells = [row["series"], row["label"], _cell(row["visual_tokens"], "{:.1f}"),
                 _cell(row["accuracy"], "{:.3f}"),
                 *(_cell(row["task_accuracy"].get(task), "{:.2f}") for task in TASKS),
                 _cell(None if ttft is None else ttft * 1000, "{:.1f}"),
                 _cell(row["decode_tok_s"], "{:.1f}"), _cell(spec.get("acceptance_rate"), "{:.2f}")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_sweep_plot(rows: list[dict], path: Path) -> None:
    """Per series: accuracy (overall and per task) against the dial, mean visual
    tokens on the right axis; one legend below, each task one colour throughout."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    series = list(dict.fromkeys(row["series"] for row in rows))
    columns = min(3, len(series))
    panel_rows = -(-len(series) // columns)
    figure = Figure(figsize=(5.2 * columns, 3.8 * panel_rows + 0.6), layout="constrained")
    axes = figure.subplots(panel_rows, columns, squeeze=False).ravel()
    legend: dict = {}
    for axis, name in zip(axes, series):
        legend.update(_panel(axis, name, [row for row in rows if row["series"] == name]))
    for axis in axes[len(series):]:
        axis.set_visible(False)
    figure.legend(list(legend.values()), list(legend), loc="outside lower center",
                  ncols=len(legend))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)


def _panel(axis, name: str, rows: list[dict]) -> dict:
    """Draw one series; returns its legend entries (label -> line)."""
    x = list(range(len(rows)))
    lines = {}
    for index, task in enumerate(TASKS):
        if any(task in row["task_accuracy"] for row in rows):
            [lines[task]] = axis.plot(x, [row["task_accuracy"].get(task) for row in rows], ".-",
                                      color=f"C{index}", alpha=0.8)
    [lines["all tasks"]] = axis.plot(x, [row["accuracy"] for row in rows], "o-", color="black",
                                     linewidth=2.5, zorder=3)
    axis.set(title=name, ylabel="accuracy", ylim=(-0.03, 1.03), xticks=x,
             xticklabels=[row["label"] for row in rows])
    axis.grid(alpha=0.3)
    tokens = axis.twinx()
    [lines["visual tokens (right axis)"]] = tokens.plot(
        x, [row["visual_tokens"] for row in rows], "s--", color="gray", alpha=0.6)
    tokens.set_ylabel("visual tokens / request")
    tokens.set_ylim(bottom=0)
    return lines
