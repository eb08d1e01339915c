"""`marinctl ladder`: fit the scaling ladder and forecast the big run (SPEC §9); compute efficiency of a
variant against a baseline law.

`ladder fit RUN_DIR... --target RECIPE` reads each rung's `recipe.toml` and eval records from its
`marinctl train` run directory; the math is `marinctl.ladder`. No JAX: it runs in about a second.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.table import Table

from marinctl.errors import UserError
from marinctl.ladder import (
    EXTENSION_WINDOW,
    IRREDUCIBLE_LOSS,
    LadderFit,
    PowerLaw,
    compute_efficiency,
    fit_ladder,
    read_rung,
    training_compute,
    write_ladder_plot,
)
from marinctl.recipe import load_recipe
from marinctl.stage import JsonOpt, QuietOpt, Stage, console, emit_json

app = typer.Typer(
    name="ladder",
    help="Scaling ladder: fit rungs and forecast a target run (SPEC §9); compute efficiency vs a law.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

RunDirsArg = Annotated[
    list[Path],
    typer.Argument(metavar="RUN_DIR", help="Rung run directories (recipe.toml + metrics.jsonl).", show_default=False),
]
TargetOpt = Annotated[Path, typer.Option("--target", help="Recipe of the run to forecast (e.g. recipes/hero.toml).")]
IrreducibleOpt = Annotated[
    float, typer.Option("--irreducible", min=0.0, help="E, the irreducible loss held fixed in the fit.")
]
ExtendOpt = Annotated[
    bool,
    typer.Option(
        "--extend/--no-extend",
        help="Extend an early-stopped rung with the least-squares line of its 60–80% evals (reported).",
    ),
]
TargetSetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a value of the TARGET recipe: section.key=value (repeatable)."),
]
PlotOpt = Annotated[Path | None, typer.Option("--plot", help="Also write a PNG of the rungs and the forecast.")]


def _rung_names(run_dirs: list[Path]) -> list[str]:
    """The directory name, or the path as given where two rungs share a directory name."""
    names = [d.name or str(d) for d in run_dirs]
    return [str(d) if names.count(n) > 1 else n for d, n in zip(run_dirs, names, strict=True)]


def fit_summary(fit: LadderFit, target: dict[str, Any], run_dirs: dict[str, Path]) -> dict[str, Any]:
    """The `--json` contract: forecast (final), per_progress, rungs, extrapolated, and the inputs."""

    def value(x: float) -> float | None:
        return float(x) if math.isfinite(x) else None

    per_progress = []
    for i, f in enumerate(fit.per_progress):
        per_progress.append(
            {
                "progress": f.progress,
                "A": f.law.A if f.law else None,
                "alpha": f.law.alpha if f.law else None,
                "forecast": f.forecast,
                "target_compute": f.target_compute,
                "residual_rms": f.residual_rms,
                "rungs": list(f.rungs),
                "losses": {c.rung.name: value(c.loss[i]) for c in fit.curves},
                "extrapolated": [c.rung.name for c in fit.curves if c.extrapolated[i]],
            }
        )
    rungs = [
        {
            "name": c.rung.name,
            "run_dir": str(run_dirs[c.rung.name]),
            "compute": c.rung.compute,
            "evals": len(c.rung.progress),
            "last_progress": c.rung.last_progress,
            "extended": bool(c.extrapolated.any()),
            "note": "; ".join(n for n in (c.rung.note, c.note) if n),
        }
        for c in fit.curves
    ]
    return {
        "forecast": fit.final.forecast,
        "target": target,
        "irreducible": fit.irreducible,
        "final_law": {"A": fit.final.law.A, "alpha": fit.final.law.alpha, "E": fit.final.law.E},
        "per_progress": per_progress,
        "rungs": rungs,
        "extrapolated": fit.extrapolated(),
    }


def render_fit(fit: LadderFit, target_name: str) -> Table:
    table = Table(
        title=f"scaling ladder → {target_name} (E = {fit.irreducible:g}; * extrapolated)", header_style="bold"
    )
    for column in ("g", "A_g", "α_g", "forecast"):
        table.add_column(column, justify="right")
    for c in fit.curves:
        table.add_column(f"{c.rung.name}\n{c.rung.compute:.3g}", justify="right")
    for i, f in enumerate(fit.per_progress):
        cells = [f"{f.progress:.2f}"]
        cells += [f"{f.law.A:#.4g}", f"{f.law.alpha:.4f}", f"[bold]{f.forecast:.4f}"] if f.law else ["—", "—", "—"]
        for c in fit.curves:
            if not np.isfinite(c.loss[i]):
                cells.append("—")
            elif c.extrapolated[i]:
                cells.append(f"[italic]{c.loss[i]:.4f}*")
            else:
                cells.append(f"{c.loss[i]:.4f}")
        table.add_row(*cells)
    return table


@app.command("fit")
def fit(
    run_dirs: RunDirsArg,
    target: TargetOpt,
    irreducible: IrreducibleOpt = IRREDUCIBLE_LOSS,
    extend: ExtendOpt = True,
    plot: PlotOpt = None,
    overrides: TargetSetOpt = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Fit log(L_g − E) = log A_g − α_g·log C_g at every 5% of progress over the rungs and forecast TARGET."""
    if len(run_dirs) < 2:
        raise UserError(f"ladder fit needs at least 2 rung run directories (got {len(run_dirs)})")
    target_recipe = load_recipe(target, overrides or ())
    names = _rung_names(run_dirs)
    rungs = [read_rung(d, n) for d, n in zip(run_dirs, names, strict=True)]
    result = fit_ladder(rungs, training_compute(target_recipe), irreducible=irreducible, extend=extend)
    final = result.final
    if final.forecast is None:
        raise UserError(f"no forecast at g = 1.00: only {len(final.rungs)} rung(s) reach it (need 2); try --extend")
    target_name = target_recipe.name or target.stem
    if plot is not None:
        write_ladder_plot(result, plot, target_name)
    target_info = {"recipe": str(target), "name": target_name, "compute": result.target_compute}
    summary = fit_summary(result, target_info, dict(zip(names, run_dirs, strict=True)))
    if as_json:
        emit_json(summary)
        return
    out = console()
    if not quiet:
        out.print(render_fit(result, target_name))
        lo, hi = EXTENSION_WINDOW
        for ext in summary["extrapolated"]:
            out.print(
                f"extrapolated: {ext['rung']} stopped at g = {ext['last_progress']:.3f}; g = "
                f"{ext['progress'][0]:.2f}–{ext['progress'][-1]:.2f} continue the least-squares line of its "
                f"{lo:.0%}–{hi:.0%} evals (L = {ext['intercept']:.4f} {'−' if ext['slope'] < 0 else '+'} "
                f"{abs(ext['slope']):.4f}·g)"
            )
        for rung in summary["rungs"]:
            if rung["note"]:
                out.print(f"note: {rung['name']}: {rung['note']}")
        if plot is not None:
            out.print(f"wrote {plot}")
    out.print(
        f"forecast for {target_name} at C = {result.target_compute:.3e} FLOPs (excl. lm_head): "
        f"[bold]{final.forecast:.4f}[/]  (L = {final.law.E:g} + {final.law.A:.4g}·C^−{final.law.alpha:.4f})"
    )


@app.command("efficiency")
def efficiency(
    A: Annotated[float, typer.Option("--A", help="Baseline law coefficient A in L(C) = E + A·C^−α.")],
    alpha: Annotated[float, typer.Option("--alpha", help="Baseline law exponent α.")],
    loss: Annotated[float, typer.Option("--loss", help="The variant's loss.")],
    compute: Annotated[float, typer.Option("--compute", help="The variant's compute C (FLOPs, excl. lm_head).")],
    E: Annotated[float, typer.Option("--E", help="Baseline law irreducible loss E.")] = IRREDUCIBLE_LOSS,
    as_json: JsonOpt = False,
) -> None:
    """Compute efficiency of a variant: C_need = (A/(L_var − E))^(1/α) over the compute it used (SPEC §9)."""
    law = PowerLaw(A=A, alpha=alpha, E=E)
    c_need, ratio = compute_efficiency(law, loss, compute)
    summary = {
        "A": A,
        "alpha": alpha,
        "E": E,
        "loss": loss,
        "compute": compute,
        "baseline_loss": float(law(compute)),
        "compute_needed": c_need,
        "efficiency": ratio,
    }
    if as_json:
        emit_json(summary)
        return
    console().print(
        f"baseline L(C) = {E:g} + {A:g}·C^−{alpha:g} reaches {loss:g} at C_need = {c_need:.4g} "
        f"(it gives {summary['baseline_loss']:.4f} at C = {compute:.4g}): compute efficiency [bold]{ratio:.3f}×[/]"
    )


stage = Stage(
    name="ladder", help="Scaling ladder fit and forecast (SPEC §9); compute efficiency.", command=fit, group=app
)
