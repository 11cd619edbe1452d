"""PNG plots for a validation report and a training run: acceptance per draft position, the accepted-length
histogram, and training curves read from the run's metrics.jsonl.

Figures are built with matplotlib's object API on an Agg canvas (no pyplot, no global backend switch), so they
render on headless machines and inside a training process alike.

metrics.jsonl: one JSON object per line. Two shapes are read:
  - the trainer's own (mtp_train.metrics): {"split": "train", "step", "loss", "lr", "top1_0", "kl_0", ...} and
    {"split": "eval", "step", "loss", "top1_0", "kl_0", ...};
  - a flat one: {"step", "loss", "lr", "eval_loss", "top1", "eval_top1"} (train and eval values on one line).
Lines that are not JSON objects (a run killed mid-write leaves half a line) are skipped and counted.
"""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

# Series name -> (line key in train records, line key in eval records); flat records use the first name too.
TRAIN_KEYS = {"loss": ("loss",), "lr": ("lr",), "top1": ("top1_0", "top1"), "kl": ("kl_0", "kl")}
EVAL_KEYS = {"loss": ("loss", "eval_loss"), "top1": ("top1_0", "top1", "eval_top1"), "kl": ("kl_0", "kl", "eval_kl")}
FLAT_EVAL_KEYS = {"loss": ("eval_loss",), "top1": ("eval_top1",), "kl": ("eval_kl",)}


def read_metrics(path: Path) -> tuple[list[dict], int]:
    """(records, number of skipped lines) from a metrics.jsonl file."""
    records, skipped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            skipped += 1
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
            records.append(record)
        else:
            skipped += 1
    return records, skipped


def _first_number(record: dict, keys: tuple[str, ...]) -> float | None:
    for key in keys:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def training_series(records: list[dict]) -> dict[str, dict[str, list[tuple[float, float]]]]:
    """{"train": {name: [(step, value)]}, "eval": {...}} for loss, lr, top1 and kl."""
    series: dict[str, dict[str, list]] = {"train": {}, "eval": {}}
    for record in records:
        step = float(record["step"])
        split = record.get("split")
        if split == "eval":
            wanted = {"eval": EVAL_KEYS}
        elif split == "train":
            wanted = {"train": TRAIN_KEYS}
        else:  # a flat record carries both
            wanted = {"train": TRAIN_KEYS, "eval": FLAT_EVAL_KEYS}
        for kind, keys in wanted.items():
            for name, candidates in keys.items():
                value = _first_number(record, candidates)
                if value is not None:
                    series[kind].setdefault(name, []).append((step, value))
    return series


def last_eval_top1(records: list[dict]) -> float | None:
    """The trainer's latest eval top-1 agreement (eval `top1_0`, or a flat record's `eval_top1`)."""
    value = None
    for record in records:
        if record.get("split") == "eval":
            found = _first_number(record, ("top1_0", "top1"))
        elif record.get("split") is None:
            found = _first_number(record, ("eval_top1",))
        else:
            found = None
        value = found if found is not None else value
    return value


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_acceptance(runs: list[dict], path: Path) -> Path:
    """Conditional acceptance at each draft position (accepted / reached) with its standard error, one line per
    temperature."""
    fig = _new_figure(6, 4)
    ax = fig.subplots()
    for run in runs:
        acceptance = run["conditional_acceptance"]
        ax.errorbar(range(1, len(acceptance) + 1), acceptance, yerr=run["conditional_acceptance_se"], marker="o",
                    capsize=3, label=f"T={run['temperature']:g}, tau={run['tau']:.2f}")
    ax.set(xlabel="draft position", ylabel="accepted / reached", ylim=(0, 1.02),
           title="Conditional acceptance per draft position")
    ax.set_xticks(range(1, len(runs[0]["conditional_acceptance"]) + 1) if runs else [])
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=100)
    return path


def plot_accepted_lengths(runs: list[dict], path: Path) -> Path:
    """Share of verify steps that accepted exactly n drafts, grouped bars per temperature."""
    fig = _new_figure(6, 4)
    ax = fig.subplots()
    width = 0.8 / max(len(runs), 1)
    for i, run in enumerate(runs):
        counts = run["accepted_length_histogram"]
        total = max(sum(counts), 1)
        xs = [n + (i - (len(runs) - 1) / 2) * width for n in range(len(counts))]
        ax.bar(xs, [c / total for c in counts], width=width, label=f"T={run['temperature']:g}")
    ax.set(xlabel="drafts accepted in a step", ylabel="share of verify steps", title="Accepted-length histogram")
    if runs:
        ax.set_xticks(range(len(runs[0]["accepted_length_histogram"])))
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=100)
    return path


def plot_training_curves(records: list[dict], path: Path) -> Path | None:
    """Loss, learning rate and top-1 agreement against the step; None when the records hold none of them."""
    series = training_series(records)
    panels = [name for name in ("loss", "lr", "top1", "kl") if series["train"].get(name) or series["eval"].get(name)]
    if not panels:
        return None
    columns = min(len(panels), 2)
    rows = -(-len(panels) // columns)
    fig = _new_figure(5 * columns, 3.5 * rows)
    axes = fig.subplots(rows, columns, squeeze=False).flatten()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    for ax, name in zip(axes, panels):
        for kind, style in (("train", "-"), ("eval", "o-")):
            points = series[kind].get(name)
            if points:
                ax.plot([s for s, _ in points], [v for _, v in points], style, markersize=3, label=kind)
        ax.set(xlabel="step", title=name)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.savefig(path, dpi=100)
    return path
