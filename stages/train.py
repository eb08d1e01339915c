"""`marinctl train RECIPE`: the end-to-end run (model, optimizer, QB, data, checkpoints, eval, metrics).

Re-running the same command resumes from the newest valid checkpoint in the run dir (default
`runs/<recipe name>`). Exit codes for schedulers: 0 done, 1 crash (or diverged), 2 user error,
3 preempted by SIGTERM/SIGUSR1 with a checkpoint written — requeue and re-run the same command.
`marinctl train RUN_DIR` continues a run from its saved recipe; either form applies the mid-run changes
recorded in RUN_DIR/schedule.toml by `marinctl switch-ep` / `extend-context` (marinctl/schedule.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from marinctl.errors import UserError
from marinctl.stage import (
    JsonOpt,
    QuietOpt,
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
    recipe_path: Annotated[
        Path,
        typer.Argument(
            help="Recipe TOML file, or a run directory to continue from its saved recipe and recorded changes.",
            show_default=False,
        ),
    ],
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
    compile_step: Annotated[
        bool,
        typer.Option("--compile", help="With --dry-run: compile the sharded step abstractly, print XLA's memory too."),
    ] = False,
    coordinator: Annotated[
        str | None, typer.Option("--coordinator", help="Multi-host: host:port of process 0 (else env or SLURM).")
    ] = None,
    num_processes: Annotated[int | None, typer.Option("--num-processes", help="Multi-host: process count.")] = None,
    process_id: Annotated[int | None, typer.Option("--process-id", help="Multi-host: this process's id.")] = None,
    forecast: Annotated[
        Path | None,
        typer.Option("--forecast", help="Track evals against a `ladder fit --out` forecast (sets eval.forecast)."),
    ] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Train a recipe: sharded steps, async checkpoints, dropless eval, metrics.jsonl, plots; resumable."""
    setup_logging(quiet, verbose)
    if forecast is not None:  # absolute, so the run dir's saved recipe finds it from any directory
        overrides = [*(overrides or []), f"eval.forecast={forecast.resolve()}"]
    if recipe_path.is_dir():  # `marinctl train RUN_DIR`: what a requeued job script runs
        from marinctl.restore import run_recipe_path

        if run_dir is not None and run_dir.resolve() != recipe_path.resolve():
            raise UserError(f"--run-dir {run_dir}: the run directory is already given as {recipe_path}")
        run_dir, recipe_path = recipe_path, run_recipe_path(recipe_path)
    recipe = open_recipe(recipe_path, overrides)
    if recipe.eval.forecast:  # a forecast for another run is refused before the run dir exists
        from marinctl.forecast import load_run_forecast

        load_run_forecast(recipe)
    if dry_run:
        from marinctl.train.launch import dry_run as build_abstract

        if compile_step:  # simulated CPU devices for the compile must exist before JAX starts
            from marinctl.train.launch import compile_device_count, ensure_host_devices

            ensure_host_devices(compile_device_count(recipe, devices))
        report = build_abstract(recipe, devices, compile_step=compile_step)
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
    est = report["planner_estimate"]
    table = Table(title=f"dry run — {report['recipe']} on {report['devices']} devices ({mesh})", header_style="bold")
    table.add_column("per device")
    table.add_column("GiB", justify="right")
    table.add_column("how")
    exact = {"params", "optimizer", "other_state"}
    for key, value in report["per_device_bytes"].items():
        if not value and key not in exact | {"total"}:
            continue  # a component of a phase that is not the peak
        how = "exact (shapes x shardings)" if key in exact else ("sum" if key == "total" else "planner estimate")
        table.add_row(key.replace("_", " "), f"{value / GiB:,.3f}", how)
    for key, value in report.get("host_bytes_per_device", {}).items():
        table.add_row(f"{key} (pinned host)", f"{value / GiB:,.3f}", "planner estimate; host memory, not in total")
    out = console()
    out.print(table)
    phases = ", ".join(f"{k} {v / GiB:,.1f}" for k, v in est["phases"].items())
    out.print(
        f"peak in the {est['peak_phase']} phase (activation GiB by phase: {phases}); {est['platform']}: "
        f"{est['compute_bytes']}-byte activations, attention {est['attention_impl']}"
    )
    out.print(
        f"{report['leaves']} state leaves, {report['state_bytes_total'] / GiB:,.1f} GiB in all; every sharded "
        "dimension divides over the mesh."
    )
    if "segments" in report:
        segs = Table(title="per-device peak of each schedule segment", header_style="bold")
        for col in ("from step", "change", "seq_len", "transport", "GiB", "host GiB"):
            segs.add_column(col, justify="left" if col == "change" else "right")
        for seg in report["segments"]:
            label = ", ".join(seg["labels"]) or "start"
            gib = f"{seg['total'] / GiB:,.1f}"
            host = f"{seg['host'] / GiB:,.1f}"
            segs.add_row(f"{seg['start_step']:,}", label, f"{seg['seq_len']:,}", seg["transport"], gib, host)
        out.print(segs)
    if "compiled" in report:
        c = report["compiled"]
        xla, plan = c["xla_bytes"], c["planner_bytes"]
        cmesh = " x ".join(f"{k}={v}" for k, v in c["mesh"].items())
        side = Table(
            title=f"compiled step on {c['devices']} {c['platform']} devices ({cmesh}) in {c['compile_seconds']:.0f} s",
            header_style="bold",
        )
        side.add_column("per device")
        side.add_column("GiB", justify="right")
        for key in ("argument", "output", "alias", "temp"):
            side.add_row(f"XLA {key}", f"{xla[key] / GiB:,.3f}")
        side.add_row("XLA peak (arg + out - alias + temp)", f"{xla['peak'] / GiB:,.3f}")
        side.add_row(f"planner ({c['platform']}, same program)", f"{plan['total'] / GiB:,.3f}")
        if xla.get("host_temp") or plan.get("host_total"):
            host = f"{xla['host_temp'] / GiB:,.3f} / {plan['host_total'] / GiB:,.3f}"
            side.add_row("XLA host temp / planner host", host)
        side.add_row("planner vs XLA", f"{100 * c['difference']:+.1f}%")
        out.print(side)
        if c["replicas_folded"] > 1:
            out.print(
                f"{c['replicas_folded']} replicas folded into one (batch / {c['replicas_folded']}): the same "
                "per-device shapes; the cross-replica gradient all-reduce is not in this program."
            )


stage = Stage(name="train", help="Train a recipe end to end (resumable; exit 3 = preempted, re-run).", command=train)
