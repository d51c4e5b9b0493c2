"""`nanograph bench plot`: a sweep's JSON (bench_sweep) drawn as a PNG: ms per decode step against the batch size, one
colour per context length, measured solid, the roofline dashed. Needs matplotlib (the `bench` extra)."""
from __future__ import annotations

import json
from pathlib import Path


def require_matplotlib():
    """matplotlib's Figure and Line2D (no pyplot: no GUI backend, no global state), or an ImportError that says how
    to get them."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
    except ImportError as exc:
        raise ImportError("plotting a sweep needs matplotlib: pip install matplotlib (or pip install "
                          "'nanograph[bench]')", name="matplotlib") from exc
    return Figure, Line2D


def plot_file(sweep_json: str, output: str):
    """Draws the sweep in sweep_json into the PNG output; returns the Figure."""
    try:
        result = json.loads(Path(sweep_json).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{sweep_json} is not JSON ({exc}); give the file that nanograph bench sweep wrote") from None
    if not isinstance(result, dict) or not isinstance(result.get("points"), list):
        raise ValueError(f"{sweep_json} holds no sweep points; give the file that nanograph bench sweep wrote")
    return plot_sweep(result, output)


def plot_sweep(result: dict, output: str | None = None):
    """The Figure of a sweep result (bench_sweep.sweep's dict), saved as a PNG to output if given."""
    measured = [point for point in result["points"] if "ms_per_step" in point]
    if not measured:
        raise ValueError("the sweep has no measured points (every one was skipped), so there is nothing to plot")
    Figure, Line2D = require_matplotlib()
    figure = Figure(figsize=(8, 5.5), layout="constrained")
    axes = figure.add_subplot()
    for i, context in enumerate(sorted({point["context"] for point in measured})):
        points = sorted((point for point in measured if point["context"] == context), key=lambda p: p["batch"])
        batches = [point["batch"] for point in points]
        axes.plot(batches, [point["ms_per_step"] for point in points], "-o", color=f"C{i}",
                  label=f"context {context}")
        axes.plot(batches, [point["roofline_ms"] for point in points], "--", color=f"C{i}")
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    batch_sizes = sorted({point["batch"] for point in measured})
    axes.set_xticks(batch_sizes, [str(batch) for batch in batch_sizes])
    axes.set_xlabel("batch size (sequences per decode step)")
    axes.set_ylabel("ms per decode step")
    axes.grid(True, which="both", alpha=0.3)
    handles, labels = axes.get_legend_handles_labels()
    roofline = Line2D([], [], linestyle="--", color="gray")
    axes.legend([*handles, roofline], [*labels, "roofline: bytes moved / copy bandwidth"], fontsize="small")
    axes.set_title(f"{Path(result['model']).name}, {result['dtype']}, on {result['device']}: decode step time\n"
                   f"(copy bandwidth {result['copy_gbs']:.0f} GB/s; solid measured, dashed roofline)",
                   fontsize="medium")
    if output is not None:
        figure.savefig(output, dpi=120)
    return figure
