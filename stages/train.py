"""`marinctl train RECIPE`: the end-to-end run (model, optimizer, QB, data, checkpoints, eval, metrics).

Re-running the same command resumes from the newest valid checkpoint in the run dir (default
`runs/<recipe name>`). Exit codes for schedulers: 0 done, 1 crash (or diverged), 2 user error,
3 preempted by SIGTERM/SIGUSR1 with a checkpoint written — requeue and re-run the same command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from marinctl.stage import (
    JsonOpt,
    QuietOpt,
    RecipeArg,
    SetOpt,
    Stage,
    VerboseOpt,
    console,
    emit_json,
    open_recipe,
    setup_logging,
)

GiB = 2**30


def train(
    recipe_path: RecipeArg,
    overrides: SetOpt = None,
    run_dir: Annotated[
        Path | None, typer.Option("--run-dir", help="Run directory (default runs/<recipe name>); re-use to resume.")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Build state and shardings abstractly, check the mesh, print memory.")
    ] = False,
    devices: Annotated[
        int | None, typer.Option("--devices", help="Device count for --dry-run when the mesh has a -1 axis.")
    ] = None,
    coordinator: Annotated[
        str | None, typer.Option("--coordinator", help="Multi-host: host:port of process 0 (else env or SLURM).")
    ] = None,
    num_processes: Annotated[int | None, typer.Option("--num-processes", help="Multi-host: process count.")] = None,
    process_id: Annotated[int | None, typer.Option("--process-id", help="Multi-host: this process's id.")] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Train a recipe: sharded steps, async checkpoints, dropless eval, metrics.jsonl, plots; resumable."""
    setup_logging(quiet, verbose)
    recipe = open_recipe(recipe_path, overrides)
    if dry_run:
        from marinctl.train.launch import dry_run as build_abstract

        report = build_abstract(recipe, devices)
        if as_json:
            emit_json(report)
        if not as_json or verbose:
            _print_dry_run(report)
        return

    from marinctl.train.distributed import resolve_distributed
    from marinctl.train.loop import RunOptions, run

    options = RunOptions(
        run_dir=run_dir or Path("runs") / recipe.name,
        quiet=quiet,
        distributed=resolve_distributed(coordinator, num_processes, process_id),
    )
    summary = run(recipe, options)
    if as_json:
        emit_json(summary.as_dict())
    if summary.message:
        console().print(summary.message if summary.exit_reason != "diverged" else f"[red]{summary.message}")
    if summary.exit_code:
        raise typer.Exit(summary.exit_code)


def _print_dry_run(report: dict[str, Any]) -> None:
    from rich.table import Table

    mesh = " x ".join(f"{k}={v}" for k, v in report["mesh"].items())
    table = Table(title=f"dry run — {report['recipe']} on {report['devices']} devices ({mesh})", header_style="bold")
    table.add_column("per device")
    table.add_column("GiB", justify="right")
    table.add_column("how")
    exact = {"params", "optimizer", "other_state"}
    for key, value in report["per_device_bytes"].items():
        how = "exact (shapes x shardings)" if key in exact else ("sum" if key == "total" else "planner estimate")
        table.add_row(key.removesuffix("_est").replace("_", " "), f"{value / GiB:,.3f}", how)
    out = console()
    out.print(table)
    out.print(
        f"{report['leaves']} state leaves, {report['state_bytes_total'] / GiB:,.1f} GiB in all; every sharded "
        "dimension divides over the mesh."
    )


stage = Stage(name="train", help="Train a recipe end to end (resumable; exit 3 = preempted, re-run).", command=train)
