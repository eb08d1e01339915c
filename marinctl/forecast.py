"""The ladder's forecast as an artifact (docs/recipe.md §9): `ladder fit --out forecast.json` writes the
per-5% forecast curve of one target run; `marinctl train` with `eval.forecast` (or `--forecast`) reads it
back and tracks the run against it, so every eval record says how far the run is from its prediction
while it trains (the post's Figure 21), not only at the end.

The file names the run it forecasts (compute, steps, tokenizer, context, eval sources): a forecast for
another run is refused rather than compared against the wrong curve.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from marinctl.errors import UserError
from marinctl.recipe import Recipe

FORMAT = "marinctl.forecast/1"
_REL_TOL = 1e-9  # compute is a float product of integers: equal recipes give equal values


def target_identity(recipe: Recipe, recipe_path: str | Path) -> dict[str, Any]:
    """What a forecast is a forecast of: the quantities its curve depends on, and what makes losses comparable."""
    from marinctl.ladder import training_compute

    return {
        "name": recipe.name or Path(recipe_path).stem,
        "recipe": str(recipe_path),
        "compute": training_compute(recipe),
        "steps": recipe.train.steps,
        "tokens_per_step": recipe.tokens_per_step,
        "tokenizer": recipe.data.tokenizer,
        "seq_len": recipe.train.seq_len,
        "eval_sources": list(recipe.eval.sources),
    }


@dataclass(frozen=True)
class Forecast:
    """A target's forecast curve: loss at each grid progress g (None where the fit had < 2 rungs)."""

    path: Path
    target: dict[str, Any]
    irreducible: float
    progress: tuple[float, ...]
    loss: tuple[float | None, ...]
    final_law: dict[str, float]
    rungs: tuple[dict[str, Any], ...] = ()  # name, run_dir, compute of each rung the fit used
    irreducible_fitted: bool = False  # E was fitted to the rungs (`ladder fit --irreducible fit`)

    def at(self, progress: float) -> float | None:
        """The forecast at progress g: linear between grid points that have one; None outside them (the
        fit starts at 5%, so step 0 has no forecast)."""
        known = [(g, v) for g, v in zip(self.progress, self.loss, strict=True) if v is not None]
        if not known:
            return None
        gs, vs = zip(*known, strict=True)
        if progress < gs[0] - 1e-9 or progress > gs[-1] + 1e-9:
            return None
        return float(np.interp(progress, gs, vs))

    def check_target(self, recipe: Recipe) -> None:
        """Refuse a forecast made for another run: compute, steps, tokenizer, context and eval sources must
        match (the loss must mean the same thing and the curve must be on this run's progress)."""
        from marinctl.ladder import training_compute

        t = self.target
        mine = {
            "compute": training_compute(recipe),
            "steps": recipe.train.steps,
            "tokenizer": recipe.data.tokenizer,
            "seq_len": recipe.train.seq_len,
            "eval_sources": list(recipe.eval.sources),
        }
        for key, value in mine.items():
            theirs = t.get(key)
            same = (
                isinstance(theirs, (int, float)) and math.isclose(theirs, value, rel_tol=_REL_TOL)
                if key == "compute"
                else theirs == value
            )
            if not same:
                shown = f"{value:.4g}" if key == "compute" else repr(value)
                other = f"{theirs:.4g}" if key == "compute" and isinstance(theirs, (int, float)) else repr(theirs)
                raise UserError(
                    f"{self.path}: a forecast for {t.get('name')!r} ({key} {other}), not for "
                    f"{recipe.name!r} ({key} {shown})"
                )


def write_forecast(summary: dict[str, Any], target: dict[str, Any], path: Path) -> Path:
    """Write the `ladder fit` summary's curve as `path` (atomically: a reader never sees half a file)."""
    path = Path(path)
    if not path.parent.is_dir():
        raise UserError(f"--out {path}: directory {path.parent} does not exist")
    doc = {
        "format": FORMAT,
        "target": target,
        "irreducible": summary["irreducible"],
        "irreducible_fitted": summary.get("irreducible_fitted", False),  # E fitted to the rungs, not given
        "final_forecast": summary["forecast"],
        "final_law": summary["final_law"],
        "curve": [
            {"progress": p["progress"], "forecast": p["forecast"], "A": p["A"], "alpha": p["alpha"]}
            for p in summary["per_progress"]
        ],
        "rungs": [{"name": r["name"], "run_dir": r["run_dir"], "compute": r["compute"]} for r in summary["rungs"]],
        "extrapolated": summary["extrapolated"],
    }
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_forecast(path: str | Path) -> Forecast:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such forecast file (write one with `marinctl ladder fit ... --out`)")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: not a readable forecast file: {err}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UserError(f"{path}: not a marinctl forecast file (format {FORMAT!r})")
    try:
        curve = doc["curve"]
        progress = tuple(float(p["progress"]) for p in curve)
        loss = tuple(None if p["forecast"] is None else float(p["forecast"]) for p in curve)
        law = {k: float(v) for k, v in doc["final_law"].items()}
        target, irreducible = dict(doc["target"]), float(doc["irreducible"])
        rungs = tuple(dict(r) for r in doc.get("rungs", ()))
    except (KeyError, TypeError, ValueError) as err:
        raise UserError(f"{path}: malformed forecast file ({type(err).__name__}: {err})") from None
    if not progress or list(progress) != sorted(set(progress)):
        raise UserError(f"{path}: the forecast curve's progress values must be distinct and increasing")
    return Forecast(path, target, irreducible, progress, loss, law, rungs, bool(doc.get("irreducible_fitted", False)))


def load_run_forecast(recipe: Recipe) -> Forecast | None:
    """The forecast named by `eval.forecast`, checked against the run; None when none is set."""
    if not recipe.eval.forecast:
        return None
    forecast = read_forecast(recipe.eval.forecast)
    forecast.check_target(recipe)
    if not recipe.eval.sources:
        raise UserError(f"eval.forecast is set but eval.sources is empty: {recipe.source} has no loss to track")
    return forecast


def read_law(path: str | Path) -> dict[str, float]:
    """A saved law (`final_law` of a forecast file, or a bare {"A", "alpha", "E"} object)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--law {path}: no such file")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"--law {path}: not readable JSON: {err}") from None
    law = doc.get("final_law", doc) if isinstance(doc, dict) else None
    try:
        return {k: float(law[k]) for k in ("A", "alpha", "E")}
    except (KeyError, TypeError, ValueError):
        raise UserError(f"--law {path}: needs A, alpha and E (a `ladder fit --out` file or a bare law)") from None
