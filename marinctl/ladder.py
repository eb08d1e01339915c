"""Scaling ladder (docs/recipe.md §9): per-progress power-law fits across rungs, the target run's forecast, and
compute efficiency against a baseline law.

At every 5% of training progress g the rungs' dropless eval macro losses are fit with
`log(L_g − E) = log A_g − α_g · log C_g` (least squares, E fixed), where C_g = g · C and C is a run's
training FLOPs without the lm_head (docs/recipe.md §7). The target is forecast at the same progress with
`E + A_g · (g · C_target)^−α_g`, so the forecast is a curve the big run can be tracked against while it
trains, not one number at the end (the post's Figure 21). Pure numpy; matplotlib only for the plot.
"""
# ruff: noqa: F722 (jaxtyping shape strings are not Python expressions)

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import Bool, Float

from marinctl.counting import flops_per_token
from marinctl.errors import UserError
from marinctl.recipe import Recipe, load_recipe

# docs/recipe.md §9: the fits happen at every 5% of training progress.
PROGRESS_GRID: tuple[float, ...] = tuple(round(0.05 * i, 2) for i in range(1, 21))
GRID_SPACING = 0.05
# docs/recipe.md §9: irreducible loss calibrated for 4k context (the May law used 1.6, the 8k 67B-A2B law 1.4).
IRREDUCIBLE_LOSS = 1.5
# docs/recipe.md §9: an early-stopped rung continues the least-squares line of its evals in this progress window.
# It ends at 80% because the data mix changes there (the bump in the post's Figure 11).
EXTENSION_WINDOW = (0.6, 0.8)
_TOL = 1e-9  # progress values come from step/steps; grid points must match them despite rounding


def grid_step(g: float, steps: int) -> int:
    """The step a run evaluates at for grid progress g: the nearest one (g · steps is rarely whole)."""
    return round(g * steps)


def step_progress(step: int, steps: int) -> float:
    """Progress g of an eval at `step`: exactly the grid's g at a grid step (round(g · steps) / steps is
    rarely g), else step / steps. From 20 steps on the grid steps are distinct and past step 0, so the
    snapped progress stays in step order."""
    if steps >= len(PROGRESS_GRID) and step > 0:
        for g in PROGRESS_GRID:
            if grid_step(g, steps) == step:
                return g
    return step / steps


def eval_grid_steps(recipe: Recipe) -> frozenset[int]:
    """Steps at which `eval.ladder_grid = true` adds an evaluation: every 5% of the run's own progress."""
    if not recipe.eval.ladder_grid:
        return frozenset()
    return frozenset(grid_step(g, recipe.train.steps) for g in PROGRESS_GRID)


def check_rung_of(rung: Recipe, target: Recipe, where: str) -> None:
    """A rung's losses are comparable with the target's only when they are the same measurement: the same
    tokenizer, context and eval sources (read from the same stores). Anything else is a user error."""
    sources = {s.name: s.path for s in rung.data.sources}
    target_sources = {s.name: s.path for s in target.data.sources}
    checks = (
        ("data.tokenizer", rung.data.tokenizer, target.data.tokenizer),
        ("train.seq_len", rung.train.seq_len, target.train.seq_len),
        ("eval.sources", list(rung.eval.sources), list(target.eval.sources)),
        (
            "eval source paths",
            [sources.get(n) for n in rung.eval.sources],
            [target_sources.get(n) for n in target.eval.sources],
        ),
    )
    for key, mine, theirs in checks:
        if mine != theirs:
            name = target.name or target.source
            raise UserError(f"{where}: not a ladder rung of {name}: {key} is {mine!r}, the target's is {theirs!r}")


def training_compute(recipe: Recipe) -> float:
    """C of recipe §9: the run's planned training FLOPs (3 · f · tokens) without the lm_head term (recipe §7)."""
    return flops_per_token(recipe).train(recipe.total_tokens, lm_head=False)


@dataclass(frozen=True)
class Rung:
    """One ladder run: its compute and its dropless eval macro loss against progress g = step / steps."""

    name: str
    compute: float
    progress: Float[np.ndarray, " evals"]  # ascending, distinct
    loss: Float[np.ndarray, " evals"]
    note: str = ""  # anything the reader must know about how the curve was read

    def __post_init__(self) -> None:
        object.__setattr__(self, "progress", np.asarray(self.progress, np.float64))
        object.__setattr__(self, "loss", np.asarray(self.loss, np.float64))
        if len(self.progress) == 0 or len(self.progress) != len(self.loss):
            raise ValueError(f"rung {self.name}: needs matching, non-empty progress and loss arrays")
        if np.any(np.diff(self.progress) <= 0):
            raise ValueError(f"rung {self.name}: progress must be strictly increasing")

    @property
    def last_progress(self) -> float:
        return float(self.progress[-1])


def read_rung(run_dir: Path, name: str | None = None) -> Rung:
    """A rung from a `marinctl train` run directory: `recipe.toml` (its compute and step count) and the
    `"kind": "eval"` records of `metrics.jsonl` (`step`, `macro_loss`).

    A repeated step keeps its last record (a resumed run re-evaluates). A non-finite loss ends the curve
    there (the run diverged), which then reads as an early stop and says so in `note`.
    """
    from marinctl.train.metrics import read_metrics

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a directory (expected a marinctl train run directory)")
    recipe_path, metrics_path = run_dir / "recipe.toml", run_dir / "metrics.jsonl"
    for path in (recipe_path, metrics_path):
        if not path.is_file():
            raise UserError(f"{run_dir}: no {path.name} (is this a marinctl train run directory?)")
    recipe = load_recipe(recipe_path)
    try:
        records = read_metrics(metrics_path)
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{metrics_path}: cannot read: {err}") from None
    by_step: dict[int, float] = {}
    for record in records:
        if not isinstance(record, dict) or record.get("kind") != "eval":
            continue
        step, loss = record.get("step"), record.get("macro_loss")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise UserError(f"{metrics_path}: eval record with a bad step {step!r}")
        if loss is None:
            continue  # an eval with no sources has no macro loss
        if isinstance(loss, bool) or not isinstance(loss, (int, float)):
            raise UserError(f"{metrics_path}: eval record at step {step} has a non-numeric macro_loss {loss!r}")
        by_step[step] = float(loss)
    if not by_step:
        raise UserError(f"{metrics_path}: no eval records with a macro_loss")
    steps = sorted(by_step)
    note = ""
    bad = [s for s in steps if not math.isfinite(by_step[s])]
    if bad:
        steps = [s for s in steps if s < bad[0]]
        note = f"macro_loss is non-finite from step {bad[0]}; curve ends at the eval before it"
        if not steps:
            raise UserError(f"{metrics_path}: macro_loss is non-finite from the first eval (step {bad[0]})")
    total = recipe.train.steps
    progress = np.asarray([step_progress(s, total) for s in steps], np.float64)
    # Every grid point the curve reaches must be read from evals at most one grid spacing apart (one step
    # in a run shorter than the grid): a line from step 0 to the end is not a loss curve.
    spacing = max(GRID_SPACING, 1 / total)
    for g in PROGRESS_GRID:
        if g > progress[-1] + _TOL:
            break
        after = int(np.searchsorted(progress, g - _TOL))
        if abs(progress[after] - g) <= _TOL:
            continue
        if after == 0 or progress[after] - progress[after - 1] > spacing + _TOL:
            raise UserError(
                f"{metrics_path}: no eval at or near the {g:.0%} grid point (step {grid_step(g, total)} of "
                f"{total}); train ladder rungs with eval.ladder_grid = true"
            )
    loss = np.asarray([by_step[s] for s in steps], np.float64)
    return Rung(name or run_dir.name, training_compute(recipe), progress, loss, note)


def extension_line(rung: Rung, window: tuple[float, float] = EXTENSION_WINDOW) -> tuple[float, float] | None:
    """(intercept, slope) of the least-squares line L(g) over the rung's evals with g in `window`
    (inclusive), or None when the window holds fewer than two evals."""
    lo, hi = window
    inside = (rung.progress >= lo - _TOL) & (rung.progress <= hi + _TOL)
    if inside.sum() < 2:
        return None
    slope, intercept = np.polyfit(rung.progress[inside], rung.loss[inside], 1)
    return float(intercept), float(slope)


@dataclass(frozen=True)
class RungOnGrid:
    """A rung's loss at each grid progress: interpolated from its evals, extended past an early stop, or
    NaN where it has neither (before its first eval, or after a stop it cannot be extended from)."""

    rung: Rung
    loss: Float[np.ndarray, " grid"]
    extrapolated: Bool[np.ndarray, " grid"]
    line: tuple[float, float] | None  # the extension line, when used
    note: str  # why an early stop was not extended, if it was not


def rung_on_grid(
    rung: Rung,
    grid: tuple[float, ...] = PROGRESS_GRID,
    *,
    extend: bool = True,
    window: tuple[float, float] = EXTENSION_WINDOW,
) -> RungOnGrid:
    """Linear interpolation of the evals at each grid g; past the last eval, the window's line (docs/recipe.md §9).

    A rung is extended only when it ran past the whole window and the window holds at least two evals, so
    the line is fit to evals that precede every extrapolated point.
    """
    g = np.asarray(grid, np.float64)
    covered = (g >= rung.progress[0] - _TOL) & (g <= rung.last_progress + _TOL)
    loss = np.where(covered, np.interp(g, rung.progress, rung.loss), np.nan)
    after = g > rung.last_progress + _TOL
    extrapolated = np.zeros_like(after)
    line, note = None, ""
    if after.any():
        if not extend:
            note = f"stopped at g={rung.last_progress:.3f}; extension off"
        elif rung.last_progress < window[1] - _TOL:
            note = (
                f"stopped at g={rung.last_progress:.3f}, before the end of the {window[0]:.0%}–{window[1]:.0%} window"
            )
        elif (line := extension_line(rung, window)) is None:
            note = (
                f"stopped at g={rung.last_progress:.3f} with fewer than 2 evals in the "
                f"{window[0]:.0%}–{window[1]:.0%} window"
            )
        else:
            loss = np.where(after, line[0] + line[1] * g, loss)
            extrapolated = after
    return RungOnGrid(rung, loss, extrapolated, line, note)


@dataclass(frozen=True)
class PowerLaw:
    """L(C) = E + A · C^−α (docs/recipe.md §9)."""

    A: float
    alpha: float
    E: float

    def __call__(self, compute: float | np.ndarray) -> float | np.ndarray:
        return self.E + self.A * np.power(compute, -self.alpha)

    def compute_needed(self, loss: float) -> float:
        """C_need = (A / (L − E))^(1/α): the compute at which this law reaches `loss` (docs/recipe.md §9)."""
        if not loss > self.E:
            raise UserError(f"loss {loss:g} must be above the irreducible loss E = {self.E:g}")
        if not self.alpha > 0 or not self.A > 0:
            raise UserError(f"the law needs A > 0 and alpha > 0 (got A = {self.A:g}, alpha = {self.alpha:g})")
        return float(np.exp((np.log(self.A) - np.log(loss - self.E)) / self.alpha))


def fit_power_law(
    compute: Float[np.ndarray, " rungs"], loss: Float[np.ndarray, " rungs"], irreducible: float
) -> tuple[PowerLaw, float]:
    """Least squares of log(L − E) = log A − α · log C over the rungs; returns the law and the RMS of the
    residuals in log(L − E) (zero for two rungs or for rungs exactly on a power law)."""
    compute, loss = np.asarray(compute, np.float64), np.asarray(loss, np.float64)
    if len(np.unique(compute)) < 2:
        raise UserError("the fit needs rungs at two or more different compute budgets")
    if np.any(loss <= irreducible):
        raise UserError(f"loss {loss.min():.4f} is not above the irreducible loss E = {irreducible:g}")
    x, y = np.log(compute), np.log(loss - irreducible)
    slope, intercept = np.polyfit(x, y, 1)
    residual_rms = float(np.sqrt(np.mean((y - (intercept + slope * x)) ** 2)))
    return PowerLaw(A=float(np.exp(intercept)), alpha=float(-slope), E=irreducible), residual_rms


def fit_irreducible(compute: Float[np.ndarray, " rungs"], loss: Float[np.ndarray, " rungs"]) -> float:
    """E for `L = E + A·C^−α` fitted to the rungs: the E in [0, min L) whose power-law fit of log(L − E) (A and
    α by least squares at that E) leaves the smallest squared error in log L. Needs three compute budgets
    (three parameters). Where the rungs show no curvature in log-log the optimum sits at the bound E = 0,
    a pure power law: data that cannot see the floor do not get one imposed on them."""
    compute, loss = np.asarray(compute, np.float64), np.asarray(loss, np.float64)
    if len(np.unique(compute)) < 3:
        raise UserError(f"fitting E needs rungs at three or more compute budgets (got {len(np.unique(compute))})")

    def error(E: float) -> float:
        law, _ = fit_power_law(compute, loss, E)
        return float(np.sum((np.log(loss) - np.log(law(compute))) ** 2))

    upper = float(loss.min()) * (1 - 1e-6)
    candidates = np.linspace(0.0, upper, 201)  # coarse scan (the error may have several minima), then refine
    best = int(np.argmin([error(E) for E in candidates]))
    lo, hi = candidates[max(best - 1, 0)], candidates[min(best + 1, len(candidates) - 1)]
    from scipy.optimize import minimize_scalar  # here, not at import: scipy costs `marinctl --help` 0.3 s

    refined = minimize_scalar(error, bounds=(lo, hi), method="bounded", options={"xatol": 1e-6})
    E = float(refined.x) if refined.fun < error(candidates[best]) else float(candidates[best])
    return 0.0 if E < 1e-4 else E


@dataclass(frozen=True)
class ProgressFit:
    """The fit at one progress g: the law over the rungs used, and the target's forecast."""

    progress: float
    law: PowerLaw | None  # None when fewer than two rungs have a loss at this g
    target_compute: float  # g · C_target
    forecast: float | None
    rungs: tuple[str, ...]  # rungs in the fit
    residual_rms: float | None


@dataclass(frozen=True)
class LadderFit:
    irreducible: float
    irreducible_fitted: bool  # E fitted to the rungs' final losses (fit_irreducible), not given
    target_compute: float
    grid: tuple[float, ...]
    curves: tuple[RungOnGrid, ...]  # ascending compute
    per_progress: tuple[ProgressFit, ...]

    @property
    def final(self) -> ProgressFit:
        return self.per_progress[-1]

    def extrapolated(self) -> list[dict[str, Any]]:
        """Which rungs' points were extended past an early stop, at which g, from which line."""
        out = []
        for curve in self.curves:
            if curve.extrapolated.any():
                out.append(
                    {
                        "rung": curve.rung.name,
                        "last_progress": curve.rung.last_progress,
                        "progress": [g for g, e in zip(self.grid, curve.extrapolated, strict=True) if e],
                        "window": list(EXTENSION_WINDOW),
                        "intercept": curve.line[0],
                        "slope": curve.line[1],
                    }
                )
        return out


def fit_ladder(
    rungs: list[Rung],
    target_compute: float,
    *,
    irreducible: float | None = IRREDUCIBLE_LOSS,
    extend: bool = True,
    grid: tuple[float, ...] = PROGRESS_GRID,
) -> LadderFit:
    """docs/recipe.md §9: at each g, fit the rungs that have a loss there and forecast `E + A_g · (g·C_target)^−α_g`.

    `irreducible=None` fits E once, to the rungs' losses at the last grid point (`fit_irreducible`), and holds
    it for every g, so the per-g laws stay comparable."""
    if len(rungs) < 2:
        raise UserError(f"a ladder fit needs at least 2 rungs (got {len(rungs)})")
    names = [r.name for r in rungs]
    if len(set(names)) != len(names):
        raise UserError(f"rung names must be distinct (got {', '.join(names)})")
    if len({r.compute for r in rungs}) < 2:
        raise UserError(
            f"the fit needs rungs at two or more different compute budgets (all are C = {rungs[0].compute:.3g})"
        )
    if not target_compute > 0:
        raise UserError(f"target compute must be positive (got {target_compute:g})")
    curves = tuple(rung_on_grid(r, grid, extend=extend) for r in sorted(rungs, key=lambda r: r.compute))
    fitted = irreducible is None
    if irreducible is None:
        last = [c for c in curves if np.isfinite(c.loss[-1])]
        irreducible = fit_irreducible(
            np.asarray([c.rung.compute for c in last]), np.asarray([c.loss[-1] for c in last])
        )
    fits = []
    for i, g in enumerate(grid):
        used = [c for c in curves if np.isfinite(c.loss[i])]
        target_g = g * target_compute
        if len({c.rung.compute for c in used}) < 2:
            fits.append(ProgressFit(g, None, target_g, None, tuple(c.rung.name for c in used), None))
            continue
        for c in used:
            if c.loss[i] <= irreducible:
                kind = "extrapolated " if c.extrapolated[i] else ""
                raise UserError(
                    f"rung {c.rung.name}: {kind}loss {c.loss[i]:.4f} at g={g:.2f} is not above the irreducible "
                    f"loss E = {irreducible:g}"
                )
        compute = np.asarray([g * c.rung.compute for c in used])
        law, rms = fit_power_law(compute, np.asarray([c.loss[i] for c in used]), irreducible)
        fits.append(ProgressFit(g, law, target_g, float(law(target_g)), tuple(c.rung.name for c in used), rms))
    return LadderFit(irreducible, fitted, target_compute, tuple(grid), curves, tuple(fits))


def compute_efficiency(law: PowerLaw, loss: float, compute: float) -> tuple[float, float]:
    """(C_need, C_need / C): the compute the baseline law needs to reach a variant's loss, and that as a
    multiple of the compute the variant used (docs/recipe.md §9; 1.18 means the baseline needs 18% more)."""
    if not compute > 0:
        raise UserError(f"compute must be positive (got {compute:g})")
    c_need = law.compute_needed(loss)
    return c_need, c_need / compute


def write_ladder_plot(fit: LadderFit, path: Path, target_name: str = "target") -> Path:
    """Two panels (PNG): the rungs' loss against progress with the target's forecast curve (the post's
    Figure 11), and the final law against compute with the rungs and the target (Figure 12)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a cluster node
    import matplotlib.pyplot as plt

    path = Path(path)
    if not path.parent.is_dir():
        raise UserError(f"--plot {path}: directory {path.parent} does not exist")
    grid = np.asarray(fit.grid)
    fig, (by_progress, by_compute) = plt.subplots(1, 2, figsize=(12, 4.8))
    for n, curve in enumerate(fit.curves):
        color = f"C{n}"
        rung = curve.rung
        after_init = rung.progress > 0  # the step-0 eval (≈ ln V) is not part of the curve being fit
        by_progress.plot(rung.progress[after_init], rung.loss[after_init], "o-", ms=3, lw=1.2, color=color,
                         label=f"{rung.name} (C = {rung.compute:.3g})")  # fmt: skip
        if curve.extrapolated.any():
            ext = curve.extrapolated
            by_progress.plot(
                grid[ext], curve.loss[ext], "o--", mfc="none", lw=1, color=color, label=f"{rung.name} (extrapolated)"
            )
    forecast = [(f.progress, f.forecast) for f in fit.per_progress if f.forecast is not None]
    if forecast:
        by_progress.plot(*zip(*forecast, strict=True), "k*--", lw=1.5, label=f"{target_name} forecast")
    by_progress.set_xlabel("training progress g")
    by_progress.set_ylabel("dropless eval macro loss (nats)")
    by_progress.set_title("rungs and per-5% forecast")
    # Frame the grid losses and the forecast: the step-0 eval (≈ log V) would squash every curve flat.
    shown = np.concatenate([c.loss for c in fit.curves] + [np.asarray([f for _, f in forecast], np.float64)])
    shown = shown[np.isfinite(shown)]
    if shown.size and shown.max() > shown.min():
        pad = 0.05 * (shown.max() - shown.min())
        by_progress.set_ylim(shown.min() - pad, shown.max() + pad)

    # Figure 12 style: the fit at a few progress points, loss against g · C, the rungs' points on each law
    # and the target's forecast at the end of each line.
    shown_g = [g for g in (0.25, 0.5, 0.75, 1.0) if any(abs(g - p) < _TOL for p in fit.grid)]
    cmap = plt.get_cmap("viridis")
    all_c = [g * c.rung.compute for g in shown_g for c in fit.curves] + [g * fit.target_compute for g in shown_g]
    xs = np.geomspace(min(all_c) / 1.5, max(all_c) * 1.5, 200) if all_c else np.asarray([])
    for k, g in enumerate(shown_g):
        i = next(j for j, p in enumerate(fit.grid) if abs(g - p) < _TOL)
        f, color = fit.per_progress[i], cmap(0.1 + 0.8 * k / max(len(shown_g) - 1, 1))
        if f.law is None:
            continue
        label = f"g={g:.2f}: A={f.law.A:.4g}, α={f.law.alpha:.4f}"
        by_compute.plot(xs, f.law(xs), "-", lw=1, color=color, label=label)
        for curve in fit.curves:
            if np.isfinite(curve.loss[i]):
                hollow = bool(curve.extrapolated[i])
                by_compute.plot(g * curve.rung.compute, curve.loss[i], "o", ms=4, color=color,
                                mfc="none" if hollow else color)  # fmt: skip
        by_compute.plot(g * fit.target_compute, f.forecast, "*", ms=11, color=color, mec="k", mew=0.6)
    final = fit.final
    if final.forecast is not None:
        by_compute.annotate(
            f"{target_name}: {final.forecast:.4f}",
            (fit.target_compute, final.forecast),
            textcoords="offset points",
            xytext=(-12, -16),
            ha="right",
            fontsize="small",
        )
    by_compute.set_xscale("log")
    by_compute.set_xlabel("training FLOPs so far, g · C (excl. lm_head)")
    by_compute.set_ylabel("dropless eval macro loss (nats)")
    E = f"{fit.irreducible:.4g}{', fitted' * fit.irreducible_fitted}"
    by_compute.set_title(f"per-progress fits L = E + A·(gC)^−α (E = {E}); ★ = forecast")
    for ax in (by_progress, by_compute):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp" + (path.suffix or ".png"))
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    tmp.replace(path)  # a reader never sees a half-written PNG
    return path
