"""`marinctl ladder`: fit the scaling ladder and forecast the big run (docs/recipe.md §9); compute efficiency of a
variant against a baseline law.

`ladder fit RUN_DIR... --target RECIPE` reads each rung's `recipe.toml` and eval records from its
`marinctl train` run directory; the math is `marinctl.ladder`. No JAX: it runs in about a second.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.table import Table

from marinctl.errors import UserError
from marinctl.forecast import read_law, target_identity, write_forecast
from marinctl.ladder import (
    EXTENSION_WINDOW,
    IRREDUCIBLE_LOSS,
    LadderFit,
    PowerLaw,
    check_rung_of,
    compute_efficiency,
    fit_ladder,
    read_rung,
    training_compute,
    write_ladder_plot,
)
from marinctl.recipe import Recipe, load_recipe
from marinctl.stage import JsonOpt, QuietOpt, Stage, console, emit_json

app = typer.Typer(
    name="ladder",
    help="Scaling ladder: fit rungs and forecast a target run (docs/recipe.md §9); compute efficiency vs a law.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

RunDirsArg = Annotated[
    list[Path],
    typer.Argument(metavar="RUN_DIR", help="Rung run directories (recipe.toml + metrics.jsonl).", show_default=False),
]
TargetOpt = Annotated[Path, typer.Option("--target", help="Recipe of the run to forecast (e.g. recipes/hero.toml).")]
IrreducibleOpt = Annotated[
    str,
    typer.Option(
        "--irreducible",
        metavar="E|fit",
        help="E, the irreducible loss held fixed in the fit; 'fit' fits E to the rungs' final losses "
        "(3+ rungs; bounded to [0, lowest loss)).",
    ),
]


def parse_irreducible(value: str) -> float | None:
    """--irreducible: a number ≥ 0, or 'fit' (None: `fit_ladder` fits E)."""
    if value.strip().lower() == "fit":
        return None
    try:
        E = float(value)
    except ValueError:
        raise UserError(f"--irreducible: expected a number or 'fit' (got {value!r})") from None
    if not (E >= 0 and np.isfinite(E)):
        raise UserError(f"--irreducible: must be a finite number ≥ 0 (got {value})")
    return E


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
OutOpt = Annotated[
    Path | None,
    typer.Option("--out", help="Write the per-5% forecast curve (JSON) for `marinctl train --forecast`."),
]


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
        "irreducible_fitted": fit.irreducible_fitted,
        "final_law": {"A": fit.final.law.A, "alpha": fit.final.law.alpha, "E": fit.final.law.E},
        "per_progress": per_progress,
        "rungs": rungs,
        "extrapolated": fit.extrapolated(),
    }


def render_fit(fit: LadderFit, target_name: str) -> Table:
    table = Table(
        title=f"scaling ladder → {target_name} (E = {fit.irreducible:.4g}{' fitted' * fit.irreducible_fitted}; "
        "* extrapolated)",
        header_style="bold",
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
    irreducible: IrreducibleOpt = str(IRREDUCIBLE_LOSS),
    extend: ExtendOpt = True,
    plot: PlotOpt = None,
    out_path: OutOpt = None,
    overrides: TargetSetOpt = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Fit log(L_g − E) = log A_g − α_g·log C_g at every 5% of progress over the rungs and forecast TARGET."""
    if len(run_dirs) < 2:
        raise UserError(f"ladder fit needs at least 2 rung run directories (got {len(run_dirs)})")
    parse_irreducible(irreducible)
    target_recipe = load_recipe(target, overrides or ())
    summary, result = _fit(run_dirs, _rung_names(run_dirs), target, target_recipe, irreducible, extend)
    if plot is not None:
        write_ladder_plot(result, plot, summary["target"]["name"])
    if out_path is not None:
        write_forecast(summary, summary["target"], out_path)
    if as_json:
        emit_json(summary)
        return
    _print_fit(summary, result, plot, out_path, quiet)


def _fit(
    run_dirs: list[Path], names: list[str], target: Path, target_recipe: Recipe, irreducible: str, extend: bool
) -> tuple[dict[str, Any], LadderFit]:
    """Read the rungs (each checked to be a rung of the target), fit, and summarize; nothing is written."""
    rungs = []
    for run_dir, name in zip(run_dirs, names, strict=True):
        rung = read_rung(run_dir, name)  # checks the run dir first, so its errors name what is missing
        check_rung_of(load_recipe(Path(run_dir) / "recipe.toml"), target_recipe, str(run_dir))
        rungs.append(rung)
    E = parse_irreducible(irreducible)
    result = fit_ladder(rungs, training_compute(target_recipe), irreducible=E, extend=extend)
    final = result.final
    if final.forecast is None:
        raise UserError(f"no forecast at g = 1.00: only {len(final.rungs)} rung(s) reach it (need 2); try --extend")
    target_info = target_identity(target_recipe, target)
    return fit_summary(result, target_info, dict(zip(names, run_dirs, strict=True))), result


def _print_fit(
    summary: dict[str, Any], result: LadderFit, plot: Path | None, out_path: Path | None, quiet: bool
) -> None:
    target_name, final = summary["target"]["name"], result.final
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
        for path in (plot, out_path):
            if path is not None:
                out.print(f"wrote {path}")
    out.print(
        f"forecast for {target_name} at C = {result.target_compute:.3e} FLOPs (excl. lm_head): "
        f"[bold]{final.forecast:.4f}[/]  (L = {final.law.E:g} + {final.law.A:.4g}·C^−{final.law.alpha:.4f})"
    )


RecipesArg = Annotated[
    list[Path], typer.Argument(metavar="RECIPE", help="Rung recipes (one run dir each).", show_default=False)
]


@dataclass
class _RungPlan:
    """One rung of `ladder run`: where it trains and what state it is in."""

    name: str
    recipe_path: Path
    recipe: Recipe
    run_dir: Path
    status: str = "todo"  # todo | done | trained | submitted | queued | failed
    wall_s: float | None = None
    job_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "recipe": str(self.recipe_path),
            "run_dir": str(self.run_dir),
            "compute": training_compute(self.recipe),
            "steps": self.recipe.train.steps,
            "status": self.status,
            "wall_s": self.wall_s,
            "job_id": self.job_id,
        }


def rung_finished(run_dir: Path, steps: int) -> bool:
    """A rung is finished when its metrics hold the final (step == steps) eval with a macro loss."""
    from marinctl.train.metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return False
    try:
        records = read_metrics(path)
    except (OSError, UnicodeDecodeError):
        return False
    return any(
        isinstance(r, dict) and r.get("kind") == "eval" and r.get("step") == steps and r.get("macro_loss") is not None
        for r in records
    )


def _plan_rungs(recipes: list[Path], root: Path, target_recipe: Recipe | None) -> list[_RungPlan]:
    """Load and check every rung before anything trains: distinct names and compute, rungs of the target."""
    plans = []
    for path in recipes:
        recipe = load_recipe(path)
        if not recipe.eval.sources:
            raise UserError(f"{path}: a ladder rung needs eval.sources (the fit reads their dropless macro loss)")
        if target_recipe is not None:
            check_rung_of(recipe, target_recipe, str(path))
        plans.append(_RungPlan(path.stem, path, recipe, root / path.stem))
    names = [p.name for p in plans]
    for plan in plans:
        if names.count(plan.name) > 1:
            raise UserError(f"two rung recipes are named {plan.name!r}: each rung trains into ROOT/<file stem>")
    by_compute: dict[float, str] = {}
    for plan in plans:
        compute = training_compute(plan.recipe)
        if compute in by_compute:
            raise UserError(
                f"rungs {by_compute[compute]} and {plan.name} have equal compute C = {compute:.4g}: a ladder needs "
                "rungs at different compute"
            )
        by_compute[compute] = plan.name
    for plan in plans:
        if rung_finished(plan.run_dir, plan.recipe.train.steps):
            plan.status = "done"
    return plans


def _train_command(plan: _RungPlan) -> list[str]:
    """The rung's `marinctl train` command line; re-running it resumes (the trainer's exact-resume contract)."""
    return [sys.executable, "-m", "marinctl.cli", "train", str(plan.recipe_path.resolve()), "--run-dir",
            str(plan.run_dir.resolve())]  # fmt: skip


def sbatch_script(plan: _RungPlan, extra: list[str]) -> str:
    """One SLURM job per rung. `--requeue` lets SLURM requeue it after a node failure or preemption; the
    trainer checkpoints and exits 3 on SIGTERM/SIGUSR1, which the script turns into a requeue itself, and
    the re-run resumes from the checkpoint (a finished rung re-run trains nothing)."""
    run_dir = plan.run_dir.resolve()
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name=ladder-{plan.name}",
        f"#SBATCH --output={run_dir.parent}/{plan.name}.slurm-%j.out",
        "#SBATCH --open-mode=append",
        "#SBATCH --requeue",
        "#SBATCH --signal=B:USR1@120",
        *(f"#SBATCH {arg}" for arg in extra),
        "# Written by `marinctl ladder run --sbatch`; submit again with sbatch (it resumes).",
        "set -u",
        f"cd {shlex.quote(str(Path.cwd()))}",
        " ".join(shlex.quote(a) for a in _train_command(plan)) + " &",
        "child=$!",
        "# The signals reach this shell: pass them on so the trainer checkpoints before the job ends.",
        "trap 'kill -USR1 $child' USR1",
        "trap 'kill -TERM $child' TERM",
        "wait $child; rc=$?",
        "while kill -0 $child 2>/dev/null; do wait $child; rc=$?; done",
        'if [ "$rc" -eq 3 ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


def _jobs_path(root: Path) -> Path:
    return root / "jobs.json"


def _queued(job_id: str) -> bool:
    """Whether SLURM still has the job (pending, running or requeued)."""
    squeue = shutil.which("squeue")
    if squeue is None:
        return False
    done = subprocess.run([squeue, "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, check=False)
    return done.returncode == 0 and bool(done.stdout.strip())


def _submit(plans: list[_RungPlan], root: Path, extra: list[str]) -> None:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UserError("--sbatch: no sbatch on PATH (is SLURM installed here?)")
    jobs_path = _jobs_path(root)
    try:
        jobs = json.loads(jobs_path.read_text()) if jobs_path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        jobs = {}
    for plan in plans:
        if plan.status == "done":
            continue
        previous = jobs.get(plan.name)
        if previous and _queued(str(previous)):
            plan.status, plan.job_id = "queued", str(previous)
            continue
        script = root / f"{plan.name}.sbatch"
        script.write_text(sbatch_script(plan, extra))
        done = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise UserError(f"sbatch {script} failed: {(done.stderr or done.stdout).strip() or done.returncode}")
        plan.job_id = done.stdout.strip().split(";")[0]
        plan.status = "submitted"
        jobs[plan.name] = plan.job_id
        tmp = jobs_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(jobs, indent=1) + "\n")
        os.replace(tmp, jobs_path)


def _train_locally(plans: list[_RungPlan], quiet: bool) -> None:
    """One rung after another, each in its own `marinctl train` process (the same command a job runs)."""
    out = console()
    for plan in plans:
        if plan.status == "done":
            continue
        if not quiet:
            out.print(f"[bold]ladder: training rung {plan.name}[/] ({plan.recipe.train.steps} steps) → {plan.run_dir}")
        command = _train_command(plan) + (["--quiet"] if quiet else [])
        t0 = time.perf_counter()
        rc = subprocess.run(command, stdout=subprocess.DEVNULL, check=False).returncode
        plan.wall_s = time.perf_counter() - t0
        if rc != 0:
            plan.status = "failed"
            what = "was preempted (checkpointed)" if rc == 3 else f"failed with exit code {rc}"
            out.print(f"rung {plan.name} {what}; see {plan.run_dir}; re-run `marinctl ladder run` to resume it")
            raise typer.Exit(rc)
        plan.status = "trained"
        if not quiet:
            out.print(f"ladder: rung {plan.name} finished in {plan.wall_s:,.0f}s")


@app.command("run")
def run_ladder(
    recipes: RecipesArg,
    root: Annotated[Path, typer.Option("--root", help="Directory holding one run dir per rung (ROOT/<stem>).")],
    target: Annotated[Path | None, typer.Option("--target", help="Recipe to forecast once every rung is done.")] = None,
    sbatch: Annotated[
        bool, typer.Option("--sbatch", help="Submit one SLURM job per rung (--requeue) instead of training here.")
    ] = False,
    sbatch_args: Annotated[
        list[str] | None,
        typer.Option("--sbatch-arg", help="Extra #SBATCH line for every job, e.g. --partition=gpu (repeatable)."),
    ] = None,
    irreducible: IrreducibleOpt = str(IRREDUCIBLE_LOSS),
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Train every rung into ROOT/<rung> (skip finished, resume unfinished), then fit and forecast TARGET.

    Writes ROOT/forecast.json (for `marinctl train --forecast`) and ROOT/ladder.png when a target is given.
    With --sbatch the jobs are submitted and the command returns; run it again to fit once they finish.
    """
    if len(recipes) < 2:
        raise UserError(f"ladder run needs at least 2 rung recipes (got {len(recipes)})")
    parse_irreducible(irreducible)  # a bad value fails now, not after the rungs have trained
    target_recipe = load_recipe(target) if target is not None else None
    plans = _plan_rungs(recipes, root, target_recipe)
    if root.exists() and not root.is_dir():
        raise UserError(f"--root {root}: not a directory")
    root.mkdir(parents=True, exist_ok=True)
    if sbatch:
        _submit(plans, root, sbatch_args or [])
    else:
        _train_locally(plans, quiet or as_json)
    report: dict[str, Any] = {"root": str(root), "rungs": [p.as_dict() for p in plans], "fit": None}
    pending = [p for p in plans if p.status not in ("done", "trained")]
    if target is not None and target_recipe is not None and not pending:
        run_dirs = [p.run_dir for p in plans]
        summary, result = _fit(run_dirs, [p.name for p in plans], target, target_recipe, irreducible, True)
        forecast_path, plot_path = root / "forecast.json", root / "ladder.png"
        write_forecast(summary, summary["target"], forecast_path)
        write_ladder_plot(result, plot_path, summary["target"]["name"])
        report["fit"], report["forecast_file"], report["plot"] = summary, str(forecast_path), str(plot_path)
        if not as_json:
            _print_fit(summary, result, plot_path, forecast_path, quiet)
    if as_json:
        emit_json(report)
        return
    if not quiet or pending:
        out = console()
        for p in plans:
            extra = f" job {p.job_id}" if p.job_id else (f" in {p.wall_s:,.0f}s" if p.wall_s is not None else "")
            out.print(f"rung {p.name}: {p.status}{extra}  ({p.run_dir})")
        if pending:
            out.print(f"{len(pending)} rung(s) not finished: run the same command again to fit once they are")


@app.command("efficiency")
def efficiency(
    run: Annotated[
        Path | None,
        typer.Argument(
            metavar="[RUN_DIR]", help="Variant run dir: its final eval macro loss and its C.", show_default=False
        ),
    ] = None,
    law_file: Annotated[
        Path | None, typer.Option("--law", help="Saved baseline law: a `ladder fit --out` file (its final law).")
    ] = None,
    A: Annotated[float | None, typer.Option("--A", help="Baseline law coefficient A in L(C) = E + A·C^−α.")] = None,
    alpha: Annotated[float | None, typer.Option("--alpha", help="Baseline law exponent α.")] = None,
    loss: Annotated[float | None, typer.Option("--loss", help="The variant's loss (default: RUN_DIR's).")] = None,
    compute: Annotated[
        float | None, typer.Option("--compute", help="The variant's C, FLOPs excl. lm_head (default: RUN_DIR's).")
    ] = None,
    E: Annotated[float | None, typer.Option("--E", help="Baseline law irreducible loss E.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Compute efficiency of a variant: C_need = (A/(L_var − E))^(1/α) over the compute it used (docs/recipe.md §9).

    The baseline law comes from --law (a saved fit, so an ablation at one size is judged against the
    ladder without refitting) or from --A/--alpha/--E; the variant from RUN_DIR or --loss/--compute."""
    if law_file is not None:
        if A is not None or alpha is not None:
            raise UserError("give the baseline law either as --law FILE or as --A/--alpha, not both")
        saved = read_law(law_file)
        A, alpha, E = saved["A"], saved["alpha"], saved["E"] if E is None else E
    if A is None or alpha is None:
        raise UserError("no baseline law: give --law FILE (from `ladder fit --out`) or --A and --alpha")
    E = IRREDUCIBLE_LOSS if E is None else E
    source = None
    if run is not None:
        rung = read_rung(run)
        loss = float(rung.loss[-1]) if loss is None else loss
        compute = rung.compute if compute is None else compute
        source = {"run_dir": str(run), "progress": rung.last_progress}
    if loss is None or compute is None:
        raise UserError("no variant: give RUN_DIR or both --loss and --compute")
    law = PowerLaw(A=A, alpha=alpha, E=E)
    c_need, ratio = compute_efficiency(law, loss, compute)
    summary = {
        "A": A,
        "alpha": alpha,
        "E": E,
        "law_file": str(law_file) if law_file else None,
        "variant": source,
        "loss": loss,
        "compute": compute,
        "baseline_loss": float(law(compute)),
        "compute_needed": c_need,
        "efficiency": ratio,
    }
    if as_json:
        emit_json(summary)
        return
    if source is not None and source["progress"] < 1:
        console().print(f"[yellow]note: {run} stopped at g = {source['progress']:.3f}; its last eval is used")
    console().print(
        f"baseline L(C) = {E:g} + {A:g}·C^−{alpha:g} reaches {loss:g} at C_need = {c_need:.4g} "
        f"(it gives {summary['baseline_loss']:.4f} at C = {compute:.4g}): compute efficiency [bold]{ratio:.3f}×[/]"
    )


stage = Stage(
    name="ladder", help="Scaling ladder fit and forecast (recipe §9); compute efficiency.", command=fit, group=app
)
