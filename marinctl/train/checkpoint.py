"""Checkpoints with orbax: asynchronous, atomic, keep-last-K plus keep-every-M, resume from the newest valid.

A checkpoint holds the whole train state (model, optimizer state, QB router bias, step = data position,
RNG) as a flat `{dotted path: array}` dict, plus a small JSON item (step, health-monitor state, the
shape of every leaf). Flat dotted paths make the files independent of Python class layout and let a
mismatch be reported by name. Orbax writes into a temporary directory and renames it when every host
has finished, so a killed save leaves only a `*.orbax-checkpoint-tmp-*` directory, which is ignored and
cleaned up; a step directory that still fails to restore is skipped in favour of the previous one.
Every process writes its own shards; orbax synchronizes the hosts.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from marinctl.errors import UserError
from marinctl.params import path_str
from marinctl.recipe import CheckpointConfig

log = logging.getLogger(__name__)

STATE, META = "state", "meta"


def flatten_state(tree: Any) -> dict[str, Any]:
    """Array leaves of `tree` keyed by their dotted path ('model.blocks.attention.w_q')."""
    flat = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = path_str(path)
        if key in flat:
            raise ValueError(f"two state leaves share the checkpoint key {key!r}")
        flat[key] = leaf
    return flat


def unflatten_like(template: Any, flat: dict[str, Any]) -> Any:
    """Inverse of `flatten_state`: put `flat[path]` where `template` has the leaf at `path`."""
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(template)
    return jax.tree_util.tree_unflatten(treedef, [flat[path_str(p)] for p, _ in leaves_with_paths])


def leaf_signature(flat: dict[str, Any]) -> dict[str, list]:
    """{path: [shape, dtype]}: stored in the metadata so a recipe mismatch is reported by leaf name."""
    return {k: [list(v.shape), str(np.dtype(v.dtype))] for k, v in flat.items()}


@dataclass(frozen=True)
class Restored:
    step: int
    state: dict[str, Any]  # flat, as saved
    meta: dict[str, Any]
    skipped: tuple[int, ...]  # newer steps that could not be restored


class Checkpoints:
    """The run's checkpoint directory. `save` returns once the arrays are copied off the devices; the
    files are written in the background (`async_save`) and published atomically."""

    def __init__(self, directory: str | Path, config: CheckpointConfig):
        self.directory = Path(directory).absolute()
        self.config = config
        options = ocp.CheckpointManagerOptions(
            max_to_keep=config.keep_last,
            keep_period=config.keep_every or None,  # steps divisible by keep_every are never deleted
            enable_async_checkpointing=config.async_save,
            cleanup_tmp_directories=True,  # the leftovers of a save killed mid-way
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=(STATE, META))

    def steps(self) -> list[int]:
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        flat = flatten_state(state)
        meta = {**meta, "step": step, "leaves": leaf_signature(flat)}
        args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(flat), META: ocp.args.JsonSave(meta)})
        self._manager.save(step, args=args, force=True)

    def restore_latest(self, abstract_state: Any) -> Restored | None:
        """Newest checkpoint that restores cleanly into `abstract_state` (ShapeDtypeStructs carrying the
        target shardings), or None when there is none. A leaf-shape mismatch is a user error (another
        recipe wrote this directory); any other failure skips to the previous checkpoint."""
        target = flatten_state(abstract_state)
        expected = leaf_signature(target)
        skipped: list[int] = []
        for step in reversed(self.steps()):
            try:
                meta = self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
            except Exception as err:  # unreadable metadata: a damaged checkpoint
                log.warning("checkpoint %d unreadable (%s); trying an older one", step, _one_line(err))
                skipped.append(step)
                continue
            _check_leaves(self.directory / str(step), meta.get("leaves", {}), expected)
            try:
                args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target)})
                flat = self._manager.restore(step, args=args)[STATE]
            except Exception as err:
                log.warning("checkpoint %d failed to restore (%s); trying an older one", step, _one_line(err))
                skipped.append(step)
                continue
            return Restored(step=step, state=flat, meta=meta, skipped=tuple(skipped))
        if skipped:
            raise UserError(
                f"{self.directory}: no checkpoint restores (tried steps {skipped}); move the directory away"
            )
        return None

    def wait(self) -> None:
        """Block until background writes are published (before exiting, or before reading them back)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def save_due(step: int, last_step: int, every: int) -> bool:
    """Every `checkpoint.every` steps (0: never in between) and always at the last step."""
    return step == last_step or (every > 0 and step % every == 0)


def _check_leaves(where: Path, stored: dict[str, list], expected: dict[str, list]) -> None:
    missing = sorted(set(expected) - set(stored))
    extra = sorted(set(stored) - set(expected))
    if missing or extra:
        name = (missing or extra)[0]
        what = "lacks" if missing else "has an unexpected"
        raise UserError(
            f"{where}: checkpoint {what} leaf {name!r} ({len(missing)} missing, {len(extra)} extra): "
            "it was written by a different recipe; use another --run-dir"
        )
    for name, (shape, dtype) in expected.items():
        if stored[name] != [shape, dtype]:
            raise UserError(
                f"{where}: checkpoint leaf {name!r} is {stored[name][1]}{stored[name][0]}, this recipe needs "
                f"{dtype}{shape}: it was written by a different recipe; use another --run-dir"
            )


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]
