"""A run tracked against its ladder forecast (the post's Figure 21): `forecast.png` in the run dir.

Top: the run's dropless eval macro loss and the forecast curve against training progress; bottom: the
relative error (actual − forecast) / forecast at each eval, with the ±2% band the forecast aims for.
Drawn from `metrics.jsonl` and the forecast file the run names (`eval.forecast`), so it works on a run
still training: the forecast is drawn to g = 1, the actual curve as far as it has got.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from marinctl.errors import UserError


def write_forecast_plot(run_dir: Path, records: list[dict[str, Any]]) -> Path | None:
    """Write `run_dir/forecast.png` when the run's evals carry a forecast; None when none do."""
    from marinctl.ladder import step_progress
    from marinctl.train.plots import _save

    evals = [r for r in records if r.get("kind") == "eval" and r.get("forecast") is not None]
    if not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps_total, curve, target = _forecast_curve(run_dir)
    all_evals = [r for r in records if r.get("kind") == "eval" and r.get("macro_loss") is not None]
    if steps_total is None:  # no readable forecast file: progress from the last eval
        steps_total = max(r["step"] for r in all_evals) or 1
    g_all = np.asarray([step_progress(r["step"], steps_total) for r in all_evals])
    loss_all = np.asarray([r["macro_loss"] for r in all_evals])
    g = np.asarray([step_progress(r["step"], steps_total) for r in evals])
    actual = np.asarray([r["macro_loss"] for r in evals])
    forecast = np.asarray([r["forecast"] for r in evals])
    rel = (actual - forecast) / forecast

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [2.2, 1]})
    shown = g_all > 0  # step 0 (≈ ln V) would squash the curves flat
    top.plot(g_all[shown], loss_all[shown], "o-", ms=3.5, lw=1.6, color="C0", label="actual (dropless eval macro)")
    if curve:
        cg, cv = zip(*curve, strict=True)
        top.plot(cg, cv, "k--", lw=1.4, label=f"ladder forecast (final {cv[-1]:.4f})")
    else:
        top.plot(g, forecast, "k--", lw=1.4, label="ladder forecast")
    top.set_ylabel("loss (nats/token)")
    name = target or run_dir.name
    top.set_title(f"{run_dir.name}: actual vs ladder forecast ({name})")
    top.grid(alpha=0.3)
    top.legend(fontsize="small")
    bottom.axhspan(-2, 2, color="tab:green", alpha=0.12, label="±2%")
    bottom.axhline(0, color="k", lw=0.8)
    bottom.plot(g, 100 * rel, "o-", ms=3.5, lw=1.2, color="C3", label="(actual − forecast) / forecast")
    last = rel[-1]
    box = {"facecolor": "white", "alpha": 0.8, "lw": 0}
    bottom.text(0.45, 0.06, f"final: {100 * last:+.2f}% at g = {g[-1]:.2f}", transform=bottom.transAxes,
                va="bottom", ha="center", fontsize="small", bbox=box)  # fmt: skip
    bottom.set_xlabel("training progress g = step / steps")
    bottom.set_ylabel("error (%)")
    bottom.set_xlim(0, 1.02)
    bottom.grid(alpha=0.3)
    bottom.legend(fontsize="small", loc="best")
    return _save(fig, run_dir / "forecast.png")


def write_rungs_plot(run_dir: Path) -> Path | None:
    """`run_dir/ladder.png`: the rungs the run's forecast came from, refit from their run dirs as the
    forecast file names them (Figures 11/12 style); None when the run has no forecast or a rung is gone."""
    from marinctl.forecast import read_forecast
    from marinctl.ladder import fit_ladder, read_rung, write_ladder_plot
    from marinctl.recipe import load_recipe

    try:
        recipe = load_recipe(run_dir / "recipe.toml")
        if not recipe.eval.forecast:
            return None
        forecast = read_forecast(recipe.eval.forecast)
        rungs = [read_rung(Path(r["run_dir"]), r["name"]) for r in forecast.rungs]
        fit = fit_ladder(rungs, float(forecast.target["compute"]), irreducible=forecast.irreducible)
        fit = dataclasses.replace(fit, irreducible_fitted=forecast.irreducible_fitted)
    except (UserError, KeyError, TypeError, ValueError):
        return None
    return write_ladder_plot(fit, run_dir / "ladder.png", str(forecast.target.get("name", run_dir.name)))


def _forecast_curve(run_dir: Path) -> tuple[int | None, list[tuple[float, float]], str | None]:
    """(steps, the forecast curve's (g, loss) points, target name) from the run's saved recipe."""
    from marinctl.forecast import read_forecast
    from marinctl.recipe import load_recipe

    try:
        recipe = load_recipe(run_dir / "recipe.toml")
        forecast = read_forecast(recipe.eval.forecast) if recipe.eval.forecast else None
    except UserError:
        return None, [], None
    if forecast is None:
        return recipe.train.steps, [], None
    curve = [(g, v) for g, v in zip(forecast.progress, forecast.loss, strict=True) if v is not None]
    return recipe.train.steps, curve, forecast.target.get("name")
