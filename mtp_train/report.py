"""A validation report as a person reads it: the printed table, report.json and the plots beside it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mtp_train.plots import last_eval_top1, plot_accepted_lengths, plot_acceptance, plot_training_curves, read_metrics


@dataclass
class RunMetrics:
    """A training run's metrics.jsonl, when the run folder has one."""

    file: Path | None = None
    records: list[dict] = field(default_factory=list)
    skipped_lines: int = 0

    @property
    def last_eval_top1(self) -> float | None:
        return last_eval_top1(self.records) if self.records else None


def read_run_metrics(run_dir: Path | None) -> RunMetrics:
    file = run_dir / "metrics.jsonl" if run_dir is not None else None
    if file is None or not file.is_file():
        return RunMetrics()
    records, skipped = read_metrics(file)
    return RunMetrics(file, records, skipped)


def format_report(report: dict) -> str:
    """The runs as a table (conditional acceptance per position +- its standard error), then the trainer's figures on
    the same text and the gap check."""
    k = report["num_draft_tokens"]
    columns = ["T", "tau", *[f"acc@{j + 1}" for j in range(k)], "speedup", "ideal", "plain tok/s", "spec tok/s"]
    rows = [[f"{run['temperature']:g}", f"{run['tau']:.3f}",
             *[f"{a:.3f}+-{e:.3f}" for a, e in zip(run["conditional_acceptance"], run["conditional_acceptance_se"])],
             f"{run['speedup']:.3f}", "-" if run["ideal_speedup"] is None else f"{run['ideal_speedup']:.3f}",
             f"{run['plain_tok_s']:.1f}", f"{run['spec_tok_s']:.1f}"]
            for run in report["runs"]]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    lines.append("acc@k: accepted at draft position k / steps that reached k (conditional), +- its standard error")
    replay = report["trainer_replay"]
    if replay:
        fmt = lambda values: " ".join(f"{v:.3f}" for v in values)  # noqa: E731
        lines.append(f"trainer on the greedy text ({replay['positions']} positions): at the runtime's verify steps "
                     f"{fmt(replay['at_verify_steps'])} (gap to greedy acc@k {fmt(report['replay_gap'])}"
                     f"{', GAP' if report['gap_flag'] else ''}); every anchor: conditional {fmt(replay['cond_top1'])}, "
                     f"top-1 {fmt(replay['top1'])}")
    for batch, rec in (report.get("recommended_k") or {}).get("by_batch_size", {}).items():
        shown = rec["k"] or "0, plain decoding"
        lines.append(f"recommended K at batch {batch}: {shown} (predicted speedup "
                     + ", ".join(f"K={k}: {v:.2f}" for k, v in rec["predicted_speedup"].items()) + ")")
    return "\n".join(lines)


def write_outputs(report: dict, out: Path, metrics: RunMetrics) -> None:
    """report.json, the acceptance plots and, with a run's metrics, its training curves."""
    out.mkdir(parents=True, exist_ok=True)
    plots = [plot_acceptance(report["runs"], out / "acceptance_per_position.png"),
             plot_accepted_lengths(report["runs"], out / "accepted_length_histogram.png")]
    if metrics.records:
        curves = plot_training_curves(metrics.records, out / "training_curves.png")
        plots += [curves] if curves else []
        report["metrics"] = {"file": str(metrics.file), "records": len(metrics.records),
                             "skipped_lines": metrics.skipped_lines}
    report["plots"] = [p.name for p in plots]
    tmp = out / ".report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(out / "report.json")
    print(f"wrote {out / 'report.json'} and {', '.join(report['plots'])}")
