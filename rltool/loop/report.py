"""`rltool report RUN`: PNG plots and one HTML page from a run's metrics, plus a summary table.

Reads RUN/metrics/loop.jsonl (one line per loop step), train.jsonl and eval.jsonl; writes
RUN/report/index.html with reward.png, response_len.png, kl.png, logprob_diff.png,
step_time.png, and when the run logged them eval_by_version.png and eval_by_time.png (eval
reward against the version it measured and against wall time), staleness.png (async runs) and
memory.png (the peak GPU memory of every phase, CUDA runs). Plots use matplotlib's Agg backend (no
display needed). Metrics missing from a run (e.g. KL without a reference model) or holding
non-numbers are plotted as "not logged" rather than failing; a row without the integer `step` and
`policy_version` every metrics row carries is bad input (one line naming file, row and field).
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from rltool import atomic
from rltool.config import StageConfig, cli
from rltool.errors import BadInputError
from rltool.rundir import RunDir, read_metrics

PHASE_KEYS = ("rollout", "train", "publish", "sync", "eval")
# Device hand-overs of the colocated loop on CUDA, timed inside the phases (rltool.loop.colocation).
HANDOVER_KEYS = ("trainer_offload", "trainer_reload", "engine_release", "engine_resume",
                 "stage_weights")


class ReportConfig(StageConfig):
    """`rltool report`."""

    run_dir: str = Field(description="Run directory of `rltool loop`.",
                         json_schema_extra=cli(argument=True, metavar="RUN_DIR"))
    out: str | None = Field(None, description="Folder for index.html and the PNGs (default "
                            "RUN/report).")


@dataclass(frozen=True)
class Plot:
    file: str
    title: str
    ylabel: str
    series: tuple[tuple[str, str, str], ...]  # (source, metric, label)


PLOTS = (
    Plot("reward.png", "Mean rollout reward", "reward",
         (("loop", "rollout/raw_reward", "rollout"), ("loop", "eval/mean_reward", "eval"))),
    Plot("response_len.png", "Mean response length", "tokens",
         (("loop", "rollout/response_len/mean", "rollout"),)),
    Plot("kl.png", "KL", "nats",
         (("train", "train/ppo_kl", "ppo_kl (new vs old, mean over the step)"),
          ("train", "train/kl_loss", "kl_loss (vs ref)"))),
    Plot("logprob_diff.png", "Train vs rollout logprob |diff|", "mean |Δ logprob|",
         (("loop", "train/train_rollout_logprob_abs_diff", "train_rollout_logprob_abs_diff"),)),
)


def _number(value: Any) -> float | None:
    """A finite int/float metric value as float; None for anything else (missing, text, NaN)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _series(rows: list[dict[str, Any]], key: str, *, x_key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = _number(r.get(key))
        if v is not None:
            xs.append(r[x_key])
            ys.append(v)
    return xs, ys


def _checked_rows(path: Path, rows: list[dict[str, Any]], *,
                  int_fields: tuple[str, ...] = ("step", "policy_version")) -> list[dict[str, Any]]:
    """The rows, after checking the fields the report indexes by are integers; a BadInputError
    naming the file, row and field otherwise (not a KeyError traceback)."""
    for number, row in enumerate(rows, 1):
        for field in int_fields:
            value = row.get(field)
            if not isinstance(value, int) or isinstance(value, bool):
                problem = "has no" if value is None else "has a non-integer"
                raise BadInputError(f"{path}: metrics row {number} {problem} {field!r} (every row "
                                    "carries integer step and policy_version); fix or delete "
                                    "that line")
        rollout_step = row.get("rollout_step")
        if rollout_step is not None and (not isinstance(rollout_step, int)
                                         or isinstance(rollout_step, bool)):
            raise BadInputError(f"{path}: metrics row {number} has a non-integer 'rollout_step'; "
                                "fix or delete that line")
    return rows


def load_metrics(run: RunDir) -> dict[str, list[dict[str, Any]]]:
    loop = _checked_rows(run.metrics_file("loop"), read_metrics(run.metrics_file("loop")))
    if not loop:
        raise BadInputError(f"{run.metrics_file('loop')}: no loop metrics; is {run.root} a "
                            "`rltool loop` run directory?")
    # One train line per optimizer step, tagged with its loop step (rollout_step); a line repeated
    # by a resumed step keeps the last copy. Plots show the mean over a loop step's lines.
    train_rows = _checked_rows(run.metrics_file("train"), read_metrics(run.metrics_file("train")))
    by_version = {r["policy_version"]: r for r in train_rows}
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in by_version.values():
        by_step.setdefault(r.get("rollout_step", r["step"]), []).append(r)
    train = []
    for step, rows in sorted(by_step.items()):
        values: dict[str, list[float]] = {}
        for r in rows:
            for k, v in r.items():
                if k != "step" and (number := _number(v)) is not None:
                    values.setdefault(k, []).append(number)
        train.append({"step": step, **{k: sum(vs) / len(vs) for k, vs in values.items()}})
    evals = _checked_rows(run.metrics_file("eval"), read_metrics(run.metrics_file("eval")))
    return {"loop": loop, "train": train, "eval": evals}


def plot_all(metrics: dict[str, list[dict[str, Any]]], out: Path) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for plot in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        drawn = 0
        for source, key, label in plot.series:
            xs, ys = _series(metrics[source], key, x_key="step")
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3, label=label)
                drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center",
                    transform=ax.transAxes)
        elif drawn > 1 or plot.series[0][2] != plot.ylabel:
            ax.legend(fontsize=8)
        _finish(fig, ax, plot.title, plot.ylabel, out / plot.file)
        plt.close(fig)
        made.append((plot.file, plot.title))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    rows = metrics["loop"]
    steps = [r["step"] for r in rows]
    bottom = [0.0] * len(rows)
    for phase in PHASE_KEYS:
        values = [_number(r.get(f"perf/loop/{phase}_time")) or 0.0 for r in rows]
        if any(values):
            ax.bar(steps, values, bottom=bottom, label=phase, width=0.8)
            bottom = [b + v for b, v in zip(bottom, values)]
    if any(bottom):
        ax.legend(fontsize=8)
    _finish(fig, ax, "Step time by phase", "seconds", out / "step_time.png")
    plt.close(fig)
    made.append(("step_time.png", "Step time by phase"))
    return made + _extra_plots(metrics, out, plt)


def _extra_plots(metrics: dict[str, list[dict[str, Any]]], out: Path,
                 plt: Any) -> list[tuple[str, str]]:
    """Eval reward against the policy version it measured and against wall time since the
    first step began (each eval.jsonl row carries both), and the staleness of an asynchronous
    run; each only when the run logged it."""
    first = metrics["loop"][0]
    start = first["time"] - (_number(first.get("perf/loop/wall_time")) or 0.0)
    evals = [(r, v) for r in metrics.get("eval", [])
             if (v := _number(r.get("eval/mean_reward"))) is not None
             and _number(r.get("time")) is not None]
    charts = []
    if evals:
        charts += [("eval_by_version.png", "Eval reward by policy version", "policy version",
                    [("eval", sorted((r["policy_version"], v) for r, v in evals))]),
                   ("eval_by_time.png", "Eval reward by wall time",
                    "seconds since the first step began",
                    [("eval", sorted((r["time"] - start, v) for r, v in evals))])]
    staleness = {k: [(r["step"], v) for r in metrics["loop"]
                     if (v := _number(r.get(f"staleness/{k}"))) is not None]
                 for k in ("mean", "max")}
    if staleness["mean"]:
        charts.append(("staleness.png", "Staleness of the trained samples", "loop step",
                       [(k, pts) for k, pts in staleness.items()]))
    memory = [(p, pts) for p in PHASE_KEYS
              if (pts := [(r["step"], v) for r in metrics["loop"]
                          if (v := _number(r.get(f"memory/{p}_peak_gib"))) is not None])]
    if memory:
        charts.append(("memory.png", "Peak GPU memory of the loop process per phase",
                       "loop step", memory))
    made = []
    for file, title, xlabel, series in charts:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for label, points in series:
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", ms=3,
                    label=label)
        ax.legend(fontsize=8)
        ylabel = {"staleness.png": "versions", "memory.png": "GiB"}.get(file,
                                                                        "eval mean reward")
        _finish(fig, ax, title, ylabel, out / file, xlabel=xlabel)
        plt.close(fig)
        made.append((file, title))
    return made


def _finish(fig: Any, ax: Any, title: str, ylabel: str, path: Path, *,
            xlabel: str = "loop step") -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic.atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)


def summarize(metrics: dict[str, list[dict[str, Any]]]) -> list[tuple[str, str, str, str]]:
    """(metric, first, last, best) rows for the summary table."""
    rows = metrics["loop"]
    out = []
    for key, best in (("rollout/raw_reward", max), ("eval/mean_reward", max),
                      ("rollout/response_len/mean", None),
                      ("train/train_rollout_logprob_abs_diff", None),
                      ("perf/loop/step_time", min),
                      *((f"perf/loop/{k}_time", min) for k in (*PHASE_KEYS, *HANDOVER_KEYS)),
                      *((f"memory/{p}_peak_gib", min) for p in PHASE_KEYS)):
        _, ys = _series(rows, key, x_key="step")
        if ys:
            out.append((key, f"{ys[0]:.4g}", f"{ys[-1]:.4g}", f"{best(ys):.4g}" if best else "-"))
    total = sum(_number(r.get("perf/loop/step_time")) or 0.0 for r in rows)
    out.append(("steps / policy version", str(rows[0]["step"]),
                f"{rows[-1]['step']} / v{rows[-1]['policy_version']}", "-"))
    out.append(("total phase time (s)", "-", f"{total:.1f}", "-"))
    return out


def write_report(run_dir: str | Path, *, out: str | Path | None = None) -> dict[str, Any]:
    """Write the plots and index.html; returns {html, plots, summary}."""
    run = RunDir(run_dir)
    metrics = load_metrics(run)
    out_dir = Path(out) if out is not None else run.report
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = plot_all(metrics, out_dir)
    summary = summarize(metrics)
    table = "".join(f"<tr><td>{html.escape(k)}</td><td>{a}</td><td>{b}</td><td>{c}</td></tr>"
                    for k, a, b, c in summary)
    images = "".join(f'<figure><img src="{f}" alt="{html.escape(t)}"><figcaption>'
                     f"{html.escape(t)}</figcaption></figure>" for f, t in plots)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>rltool report: "
            f"{html.escape(str(run.root))}</title><style>body{{font-family:sans-serif;margin:2em}}"
            "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px}"
            "figure{display:inline-block;margin:1em}</style></head><body>"
            f"<h1>rltool run {html.escape(str(run.root))}</h1>"
            "<table><tr><th>metric</th><th>first</th><th>last</th><th>best</th></tr>"
            f"{table}</table>{images}</body></html>\n")
    index = out_dir / "index.html"
    atomic.write_text(index, page)
    return {"html": str(index), "plots": [str(out_dir / f) for f, _ in plots],
            "summary": [dict(zip(("metric", "first", "last", "best"), r)) for r in summary]}
