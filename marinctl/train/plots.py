"""Plots of a run (PNG, matplotlib Agg): loss and eval macro loss, drop rate and routing entropy, norms.

Read from `metrics.jsonl` only, so `marinctl plot RUN_DIR` works on a finished, running or copied run.
Each mid-run change (a `"kind": "change"` record: EP switch, context extension, data mix; docs/recipe.md
§8) is a dashed vertical line on the loss, eval and drop-rate plots, labelled like the post's Figure 1.
After a context extension the eval macro loss is drawn at the run's first context (continuing the curve,
as the hero re-evaluated every checkpoint at 4k) and at the current one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from marinctl.errors import UserError
from marinctl.train.metrics import read_metrics


def write_plots(run_dir: Path) -> list[Path]:
    """Write loss.png, routing.png and norms.png (when norms were logged) into `run_dir`; return them."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a cluster node
    import matplotlib.pyplot as plt

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl (is this a marinctl run directory?)")
    records = read_metrics(path)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    changes = [r for r in records if r.get("kind") == "change"]
    if not train and not evals:
        raise UserError(f"{path}: no train or eval records yet")
    written = []

    fig, ax = plt.subplots(figsize=(8, 4.5))
    if train:
        ax.plot(*_series(train, "loss"), lw=0.8, alpha=0.6, label="train loss")
        ax.plot(*_series(train, "ce"), lw=0.8, alpha=0.6, label="train CE")
    if evals:
        first = _first_context(evals)
        later = [r for r in evals if r.get("seq_len", first) != first]
        label = "eval macro loss (dropless)" + (f" @ first context {first}" if later else "")
        ax.plot(*_first_context_series(evals, first), "o-", lw=2, label=label)
        if later:
            ax.plot(*_series(later, "macro_loss"), "s-", lw=2, label="eval macro loss (dropless) @ current context")
        for key in sorted({k for r in evals for k in r if k.startswith("loss/")}):
            ax.plot(*_series(evals, key), ".--", lw=1, label=f"eval {key[5:]}")
    _mark_changes(ax, changes)
    _finish(ax, "step", "loss (nats/token)", f"{run_dir.name}: loss")
    written.append(_save(fig, run_dir / "loss.png"))

    if train:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        ax.plot(*_series(train, "drop_frac"), lw=1, color="tab:red", label="token drop fraction")
        ax.set_ylabel("drop fraction")
        twin = ax.twinx()
        twin.plot(*_series(train, "routing_entropy"), lw=1, color="tab:blue", label="routing entropy")
        twin.set_ylabel("routing entropy of expert load (nats; ln E is uniform)")
        lines = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(lines, [line.get_label() for line in lines], loc="center right", fontsize="small")
        _mark_changes(ax, changes)
        _finish(ax, "step", None, f"{run_dir.name}: routing", legend=False)
        written.append(_save(fig, run_dir / "routing.png"))

    norm_keys = sorted({k for r in train for k in r if k.startswith("param_norm/")})
    if norm_keys:
        fig, ax = plt.subplots(figsize=(9, 5))
        for key in norm_keys:
            steps, values = _series(train, key)
            ax.plot(steps, values, lw=1, label=key.removeprefix("param_norm/"))
        ax.set_yscale("log")
        _finish(ax, "step", "Frobenius norm (RMS over layers)", f"{run_dir.name}: parameter norms", small=True)
        written.append(_save(fig, run_dir / "norms.png"))

    from marinctl.ladder_plots import write_forecast_plot, write_rungs_plot  # a run tracked against a forecast

    if (forecast := write_forecast_plot(run_dir, records)) is not None:
        written.append(forecast)
        if (rungs := write_rungs_plot(run_dir)) is not None:
            written.append(rungs)
    return written


def _first_context(evals: list[dict[str, Any]]) -> int | None:
    """The run's first eval context: the seq_len of its first eval record (None: records predate it)."""
    return evals[0].get("seq_len")


def _first_context_series(evals: list[dict[str, Any]], first: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Macro loss at the first context across the whole run: `macro_loss` while the run is still at it,
    then the labelled re-evaluation `macro_loss@<first>`."""
    steps, values = [], []
    for r in evals:
        at_first = r.get("seq_len", first) == first
        value = r.get("macro_loss") if at_first else r.get(f"macro_loss@{first}")
        if value is not None:
            steps.append(r["step"])
            values.append(value)
    return np.asarray(steps), np.asarray(values, np.float64)


def _mark_changes(ax: Any, changes: list[dict[str, Any]]) -> None:
    """A dashed line per change, its label written along it at the top of the axes."""
    for record in changes:
        ax.axvline(record["step"], ls="--", lw=1, color="0.35", zorder=0)
        ax.text(record["step"], 0.98, f" {record.get('name', 'change')}", transform=ax.get_xaxis_transform(),
                rotation=90, va="top", ha="right", fontsize="x-small", color="0.25",
                bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none", "pad": 1})  # fmt: skip


def _series(records: list[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of `key`; per-layer lists are reduced to their RMS."""
    steps, values = [], []
    for r in records:
        if key in r and r[key] is not None:
            v = np.asarray(r[key], np.float64)
            steps.append(r["step"])
            values.append(float(np.sqrt(np.mean(v**2))) if v.ndim else float(v))
    return np.asarray(steps), np.asarray(values)


def _finish(ax: Any, xlabel: str, ylabel: str | None, title: str, *, legend: bool = True, small: bool = False) -> None:
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend(fontsize="x-small" if small else "small", ncol=2 if small else 1)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)  # a reader never sees a half-written PNG
    return path
