"""`marinctl import DIR --run-dir RUN [--step N]`: an HF-format export back into a fresh run directory.

The run directory gets the export's recipe.toml and one checkpoint at step N (default 0) holding the
export's weights and QB router bias, a fresh optimizer state and the step's data position, so `marinctl
train` continues (or fine-tunes) from it like from any checkpoint of its own, and `marinctl export RUN
--format hf` of the imported run reproduces the export byte for byte (with `--step` equal to the
export's step, which config.json records). The run directory must not exist or be empty: an import
never mixes into another run. It is assembled in a private sibling and renamed into place.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from marinctl.errors import UserError
from marinctl.stage import JsonOpt, QuietOpt, Stage, VerboseOpt, console, emit_json, setup_logging


def import_run(
    directory: Annotated[
        Path, typer.Argument(help="An hf export written by `marinctl export --format hf`.", show_default=False)
    ],
    run_dir: Annotated[Path, typer.Option("--run-dir", help="Run directory to create (absent or empty).")],
    step: Annotated[int, typer.Option("--step", help="Step the checkpoint is saved at (data position).")] = 0,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Import an hf export into a fresh run directory (weights + router bias, fresh optimizer state)."""
    setup_logging(quiet, verbose)
    if step < 0:
        raise UserError(f"--step {step}: must be ≥ 0")
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        raise UserError(f"--run-dir {run_dir}: exists and is not empty; import into a fresh directory")
    from marinctl.hf.export import load_hf_export

    exported = load_hf_export(directory)  # every check before anything is written
    recipe = exported.recipe
    if recipe.checkpoint.dir:
        raise UserError(
            f"{directory}/recipe.toml: checkpoint.dir = {recipe.checkpoint.dir!r}; an import writes RUN_DIR/checkpoints"
        )
    run_dir = run_dir.absolute()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{run_dir.name}.import-", dir=run_dir.parent))
    try:
        write_run(staging, recipe, exported.params, exported.router_bias, step)
        if run_dir.exists():
            run_dir.rmdir()  # empty (checked above); fails if someone filled it meanwhile
        os.rename(staging, run_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    summary = {"run_dir": str(run_dir), "step": step, "recipe": recipe.name, "from": str(directory)}
    if as_json:
        emit_json(summary)
    elif not quiet:
        console().print(f"imported {directory} into {run_dir} at step {step} (recipe {recipe.name})")


def write_run(run_dir: Path, recipe, params, router_bias, step: int) -> None:
    """recipe.toml + checkpoint `step`: the trainer's own state layout (`marinctl.train.state.TrainState`)."""
    import dataclasses

    from marinctl.train.loop import configure_jax

    configure_jax()
    import jax
    import jax.numpy as jnp

    from marinctl.model.transformer import build_model
    from marinctl.params import param_table
    from marinctl.recipe import recipe_to_toml
    from marinctl.train.checkpoint import Checkpoints
    from marinctl.train.monitors import HealthMonitor
    from marinctl.train.state import TrainState, make_optimizer, model_key
    from marinctl.train.step import param_norms

    (run_dir / "recipe.toml").write_text(recipe_to_toml(recipe))
    optimizer = make_optimizer(recipe)

    def build(params, bias):
        model = build_model(recipe, params)
        return TrainState(
            model=model,
            opt_state=optimizer.init(model),
            router_bias=bias,
            step=jnp.asarray(step, jnp.int32),
            rng=jax.random.key_data(jax.random.fold_in(model_key(recipe), 1)),  # as `init_state`
            nonfinite_skipped=jnp.zeros((), jnp.int32),
        )

    state = jax.jit(build)({k: jnp.asarray(v) for k, v in params.items()}, jnp.asarray(router_bias, jnp.float32))
    table = param_table(recipe)
    monitor = HealthMonitor(
        recipe.log,
        recipe.train.max_nonfinite_steps,
        hyperball=tuple(p for p, s in table.items() if s.group in ("muonh", "adamh")),
        matrices=tuple(p for p, s in table.items() if s.init == "normal"),
    )
    monitor.start(jax.device_get(jax.jit(lambda m: param_norms(m, recipe))(state.model)))
    config = dataclasses.replace(recipe.checkpoint, async_save=False)
    checkpoints = Checkpoints(run_dir / "checkpoints", config)
    try:
        checkpoints.save(step, state, {"monitors": monitor.state_dict(), "recipe": recipe.name, "imported": True})
        checkpoints.wait()
    finally:
        checkpoints.close()


stage = Stage(
    name="import",
    help="Import an hf export into a fresh run directory (weights + router bias) to continue or fine-tune.",
    command=import_run,
)
