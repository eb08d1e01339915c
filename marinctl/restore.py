"""Read a finished (or running) training run back: its resolved recipe, and the weights of one checkpoint.

`marinctl eval` and `marinctl export` need only the model and the QB router bias (docs/recipe.md §3.5: selection
reads the bias, so it travels with the weights), not the optimizer state the trainer checkpoints beside
them, so this restores just those leaves (orbax partial restore) — a third of the bytes the full train
state holds. The checkpoint directory is opened read-only: unlike the trainer's `Checkpoints`, it never
creates directories or cleans up a save that a live run is still writing, so a run can be evaluated
while it trains. The on-disk layout (flat dotted keys, a JSON item with each leaf's shape) is the
trainer's (`marinctl/train/checkpoint.py`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from marinctl.errors import UserError
from marinctl.params import param_table, partition_spec
from marinctl.recipe import Recipe

log = logging.getLogger(__name__)

RECIPE_FILE = "recipe.toml"
MODEL_PREFIX = "model."  # train state leaf `model.<table path>` (TrainState.model)
ROUTER_BIAS = "router_bias"  # train state leaf [L, E] (TrainState.router_bias)


@dataclass(frozen=True)
class RunWeights:
    """One checkpoint's weights: `params` keyed by parameter-table path (fp32 master weights)."""

    step: int
    params: dict[str, Any]  # numpy arrays, or jax arrays laid out on the mesh
    router_bias: Any  # [L, E]
    checkpoint_dir: Path
    skipped: tuple[str, ...] = ()  # newer checkpoints found damaged, one line each: which and why


def run_recipe_path(run_dir: Path) -> Path:
    """The run's resolved recipe (written by `marinctl train`); a bad run dir is the user's mistake."""
    if not run_dir.exists():
        raise UserError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a directory (expected a run directory written by `marinctl train`)")
    path = run_dir / RECIPE_FILE
    if not path.is_file():
        raise UserError(f"{run_dir}: no {RECIPE_FILE}: not a run directory written by `marinctl train`")
    return path


def checkpoint_dir(recipe: Recipe, run_dir: Path) -> Path:
    """Where the trainer put the checkpoints: `checkpoint.dir`, else RUN_DIR/checkpoints."""
    return Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else run_dir / "checkpoints"


def checkpoint_steps(directory: Path) -> list[int]:
    """Committed checkpoint steps, oldest first (a save still in flight is not listed)."""
    if not directory.is_dir():
        return []
    with _read_only_manager(directory) as manager:
        return sorted(manager.all_steps())


def restore_weights(recipe: Recipe, run_dir: Path, step: int | None = None, mesh=None) -> RunWeights:
    """Model parameters and router bias of checkpoint `step` (default: the newest that restores).

    With a `mesh` every parameter is restored straight into its training layout (the table's sharding
    rule), the bias replicated; without one, as host numpy arrays (for export). The stored leaf shapes
    are checked against `recipe` first, so a `--set` that changes the model is named, not a crash.
    """
    directory = checkpoint_dir(recipe, run_dir)
    steps = checkpoint_steps(directory)
    if not steps:
        raise UserError(f"{run_dir}: no checkpoint in {directory}")
    if step is not None and step not in steps:
        raise UserError(f"{run_dir}: no checkpoint at step {step} (available: {_show_steps(steps)})")
    from marinctl.train.checkpoint import verify_digest

    candidates = [step] if step is not None else list(reversed(steps))
    skipped: list[str] = []
    with _read_only_manager(directory) as manager:
        for i, candidate in enumerate(candidates):
            # Orbax has no checksums: a flipped bit restores silently, so the trainer's digest is checked first.
            problem = verify_digest(directory / str(candidate))
            if problem is None:
                try:
                    weights = _restore_step(manager, recipe, directory, candidate, mesh)
                except UserError:
                    raise
                except Exception as err:  # a damaged checkpoint: the newest-first search moves to an older one
                    problem = f"does not restore ({_one_line(err)})"
                else:
                    if skipped:
                        log.warning("using checkpoint %d instead (%s)", candidate, "; ".join(skipped))
                    return dataclasses.replace(weights, skipped=tuple(skipped))
            if step is not None or i + 1 == len(candidates):
                raise UserError(f"{directory / str(candidate)}: checkpoint is damaged: {problem}")
            skipped.append(f"checkpoint {candidate} is damaged: {problem}")
            log.warning("checkpoint %d is damaged (%s); trying an older one", candidate, problem)
    raise AssertionError("unreachable: the loop returns or raises")


def _restore_step(manager, recipe: Recipe, directory: Path, step: int, mesh) -> RunWeights:
    import jax
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding, PartitionSpec

    from marinctl.train.checkpoint import META, STATE

    meta = manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
    stored = meta.get("leaves", {})
    table = param_table(recipe)
    L, E = recipe.model.num_layers, recipe.moe.num_experts
    wanted = {MODEL_PREFIX + path: (list(spec.shape), "float32") for path, spec in table.items()}
    wanted[ROUTER_BIAS] = ([L, E], "float32")
    for key, (shape, dtype) in wanted.items():
        if key not in stored:
            raise UserError(
                f"{directory / str(step)}: checkpoint lacks {key!r}: written by a different recipe (did --set change "
                "the model?)"
            )
        if stored[key] != [shape, dtype]:
            raise UserError(
                f"{directory / str(step)}: checkpoint leaf {key!r} is {stored[key][1]}{stored[key][0]}, the recipe "
                f"needs {dtype}{shape} (did --set change the model?)"
            )

    item = {key: jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype)) for key, (shape, dtype) in wanted.items()}
    if mesh is None:
        restore_args = {key: ocp.RestoreArgs(restore_type=np.ndarray) for key in item}
    else:
        sizes = dict(mesh.shape)
        shardings = {
            MODEL_PREFIX + path: NamedSharding(mesh, PartitionSpec(*partition_spec(spec, sizes)))
            for path, spec in table.items()
        }
        shardings[ROUTER_BIAS] = NamedSharding(mesh, PartitionSpec())
        restore_args = {key: ocp.ArrayRestoreArgs(sharding=shardings[key]) for key in item}
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    flat = manager.restore(step, args=ocp.args.Composite(**{STATE: args}))[STATE]
    params = {path: flat[MODEL_PREFIX + path] for path in table}
    return RunWeights(step=step, params=params, router_bias=flat[ROUTER_BIAS], checkpoint_dir=directory)


@contextmanager
def _read_only_manager(directory: Path) -> Iterator[Any]:
    import orbax.checkpoint as ocp

    from marinctl.train.checkpoint import META, STATE

    options = ocp.CheckpointManagerOptions(
        read_only=True, create=False, save_interval_steps=0, max_to_keep=None, cleanup_tmp_directories=False
    )
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # orbax warns "Given directory is read only" on every open: it is, on purpose
    try:
        manager = ocp.CheckpointManager(
            directory.absolute(),
            options=options,
            item_handlers={STATE: ocp.PyTreeCheckpointHandler(), META: ocp.JsonCheckpointHandler()},
        )
    finally:
        absl.setLevel(level)
    try:
        yield manager
    finally:
        manager.close()


def _show_steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 12 else f"{steps[0]} … {steps[-1]} ({len(steps)} checkpoints)"


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]
