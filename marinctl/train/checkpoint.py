"""Checkpoints with orbax: asynchronous, atomic, keep-last-K plus keep-every-M, resume from the newest valid.

A checkpoint holds the whole train state (model, optimizer state, QB router bias, step = data position,
RNG) as a flat `{dotted path: array}` dict, plus a small JSON item (step, health-monitor state, the
shape of every leaf). Flat dotted paths make the files independent of Python class layout and let a
mismatch be reported by name. Orbax writes into a temporary directory and renames it when every host
has finished, so a killed save leaves only a `*.orbax-checkpoint-tmp-*` directory, which is ignored and
cleaned up; a step directory that still fails to restore is skipped in favour of the previous one.
Every process writes its own shards; orbax synchronizes the hosts.

Damage orbax cannot see: its files carry no checksums, so a flipped bit in an array chunk restores
silently as a different number (measured: 4 of 5 flipped offsets in a zstd chunk did). Once a save is
published, process 0 writes a SHA-256 of every file of the step (DIGEST_FILE, in a background thread,
off the training path); a restore checks it first. A damaged newest checkpoint is not deleted and not
left in place: it is renamed `<step>.damaged-<time>` (kept for inspection, invisible to orbax), so the
run falls back to the previous one and can later write that step again. A save that runs out of disk
space stops the run with `CheckpointDiskFull` naming the directory and the bytes it needs; the
published checkpoints before it are untouched.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
import time
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
DIGEST_FILE = "marinctl.sha256.json"  # {relative path: sha256} of a published step directory
DAMAGED = ".damaged-"  # `<step>.damaged-<time>`: a set-aside step directory


class CheckpointDiskFull(Exception):
    """A checkpoint write ran out of space: the run stops (exit 1) and names what to free."""


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
    reasons: tuple[str, ...] = ()  # one line per skipped step: which, why, where it was set aside


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
        self._sealer: threading.Thread | None = None
        _quiet_disk_full_threads()
        self._sealed: set[int] = set()
        self._pending_bytes = 0

    def steps(self) -> list[int]:
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        flat = flatten_state(state)
        meta = {**meta, "step": step, "leaves": leaf_signature(flat)}
        args = ocp.args.Composite(**{STATE: ocp.args.StandardSave(flat), META: ocp.args.JsonSave(meta)})
        self._pending_bytes = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in flat.values())
        with self._disk_full_as(step):
            self._manager.save(step, args=args, force=True)  # waits for the previous save first
        self._seal_published()

    def _seal_published(self, block: bool = False) -> None:
        """Digest every published step that has none yet (process 0; a background thread unless `block`)."""
        if jax.process_index() != 0:
            return
        if self._sealer is not None:
            self._sealer.join()
        todo = [self.directory / str(s) for s in self._manager.all_steps() if s not in self._sealed]
        todo = [d for d in todo if d.is_dir() and not (d / DIGEST_FILE).exists()]
        self._sealed.update(int(d.name) for d in todo)
        if not todo:
            return
        self._sealer = threading.Thread(target=_seal_all, args=(todo,), name="marinctl-digest", daemon=True)
        self._sealer.start()
        if block:
            self._sealer.join()

    @staticmethod
    def _is_disk_full(err: BaseException) -> bool:
        seen: BaseException | None = err
        while seen is not None:
            if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
                return True
            if "No space left on device" in str(seen) or "Disk quota exceeded" in str(seen):
                return True  # tensorstore reports ENOSPC as a ValueError carrying the OS message
            seen = seen.__cause__ or seen.__context__
        return False

    def _disk_full_as(self, step: int):
        """Context manager: a full disk during a save becomes `CheckpointDiskFull` naming path and bytes."""
        manager = self

        class _Guard:
            def __enter__(self):
                return self

            def __exit__(self, kind, err, tb):
                if err is None or not manager._is_disk_full(err):
                    return False
                free = shutil.disk_usage(manager.directory).free
                kept = manager.steps()
                # What one more checkpoint takes: the newest published one's files, else the raw array bytes.
                need = _dir_bytes(manager.directory / str(kept[-1])) if kept else manager._pending_bytes
                raise CheckpointDiskFull(
                    f"{manager.directory}: disk full while writing a checkpoint (step {step} or the one before): "
                    f"it needs about {_bytes(need)} ({need:,} bytes), {_bytes(free)} are free; "
                    f"{'checkpoints ' + ', '.join(map(str, kept)) + ' are intact' if kept else 'no checkpoint yet'}"
                    "; free space and re-run the same command to resume"
                ) from None

        return _Guard()

    def restore_latest(self, abstract_state: Any) -> Restored | None:
        """Newest checkpoint that restores cleanly into `abstract_state` (ShapeDtypeStructs carrying the
        target shardings), or None when there is none. A leaf-shape mismatch is a user error (another
        recipe wrote this directory); a damaged checkpoint (digest mismatch, unreadable files) is set
        aside and the previous one tried."""
        target = flatten_state(abstract_state)
        expected = leaf_signature(target)
        skipped: list[int] = []
        reasons: list[str] = []
        for step in reversed(self.steps()):
            problem = verify_digest(self.directory / str(step))
            if problem is None:
                try:
                    meta = self._manager.restore(step, args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]
                except Exception as err:  # unreadable metadata: a damaged checkpoint
                    problem = f"metadata unreadable ({_one_line(err)})"
            if problem is None:
                _check_leaves(self.directory / str(step), meta.get("leaves", {}), expected)
                try:
                    args = ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target)})
                    flat = self._manager.restore(step, args=args)[STATE]
                except Exception as err:
                    problem = f"arrays do not restore ({_one_line(err)})"
            if problem is None:
                # Only now, with a good one in hand, are the damaged newer ones moved out of the way; when
                # none restores, everything stays where it is for the operator.
                for i, where in enumerate(self._set_aside(skipped)):
                    reasons[i] += f"; set aside as {where}; resuming from checkpoint {step}"
                    log.warning("%s", reasons[i])
                return Restored(step=step, state=flat, meta=meta, skipped=tuple(skipped), reasons=tuple(reasons))
            skipped.append(step)
            reasons.append(f"checkpoint {step} is damaged: {problem}")
        if skipped:
            raise UserError(f"{self.directory}: no checkpoint restores ({'; '.join(reasons)}); move the directory away")
        return None

    def _set_aside(self, steps: list[int]) -> list[str]:
        """Rename damaged step directories out of orbax's sight (process 0, after every process gave up on
        them), so the step can be written again and the bytes stay for inspection."""
        if not steps:
            return []
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("marinctl-damaged-checkpoints")
        stamp = time.strftime("%Y%m%dT%H%M%S")
        moved = []
        for step in steps:
            source = self.directory / str(step)
            dest = self.directory / f"{step}{DAMAGED}{stamp}"
            if jax.process_index() == 0 and source.exists():
                os.replace(source, dest)
            moved.append(str(dest))
        self._manager.reload()
        return moved

    def wait(self) -> None:
        """Block until background writes are published and digested (before exiting or reading them back)."""
        with self._disk_full_as(max(self._manager.all_steps(), default=0)):
            self._manager.wait_until_finished()
        self._seal_published(block=True)

    def close(self) -> None:
        if self._sealer is not None:
            self._sealer.join()
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


def _seal_all(step_dirs: list[Path]) -> None:
    for step_dir in step_dirs:
        try:
            write_digest(step_dir)
        except OSError as err:  # e.g. the disk filled up: the checkpoint stays valid, just unverified
            log.warning("%s: could not write %s (%s)", step_dir, DIGEST_FILE, err)


def _digest_files(step_dir: Path) -> dict[str, str]:
    out = {}
    for path in sorted(step_dir.rglob("*")):
        if path.is_file() and path.name != DIGEST_FILE and not path.name.startswith(DIGEST_FILE):
            with path.open("rb") as f:
                out[path.relative_to(step_dir).as_posix()] = hashlib.file_digest(f, "sha256").hexdigest()
    return out


def write_digest(step_dir: Path) -> None:
    """SHA-256 of every file of a published step directory, written atomically beside them."""
    tmp = step_dir / (DIGEST_FILE + ".tmp")
    tmp.write_text(json.dumps(_digest_files(step_dir), indent=0))
    os.replace(tmp, step_dir / DIGEST_FILE)


def verify_digest(step_dir: Path) -> str | None:
    """None when the step's files match its digest (or it has none yet), else what is wrong, in words."""
    path = step_dir / DIGEST_FILE
    if not path.exists():
        return None  # killed between publishing and digesting: orbax's atomic rename still vouches for it
    try:
        wanted = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return f"{DIGEST_FILE} unreadable ({err})"
    for rel, digest in wanted.items():
        file = step_dir / rel
        if not file.is_file():
            return f"file {rel} is missing"
        with file.open("rb") as f:
            if hashlib.file_digest(f, "sha256").hexdigest() != digest:
                return f"file {rel} does not match its SHA-256 (truncated, overwritten or bit rot)"
    return None


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _quiet_disk_full_threads() -> None:
    """Orbax's background writer re-raises a full disk in its own thread and asyncio logs the futures it
    never collected, each a traceback beside the run's one-line message; `CheckpointDiskFull` already
    reports it, so those are dropped. Any other thread exception or log record passes unchanged."""
    previous = threading.excepthook
    if getattr(previous, "_marinctl_disk_full", False):
        return
    for name in ("asyncio", "absl"):  # "exception was never retrieved"; orbax's "_SignalingThread.run() raised"
        logging.getLogger(name).addFilter(_drop_disk_full_records)

    def hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None and Checkpoints._is_disk_full(args.exc_value):
            log.debug("background checkpoint writer: %s", _one_line(args.exc_value))
            return
        previous(args)

    hook._marinctl_disk_full = True  # type: ignore[attr-defined]
    threading.excepthook = hook
    previous_unraisable = sys.unraisablehook

    def unraisable(args) -> None:
        # Writer callbacks that complete after the failed save find its asyncio loop closed; nothing is lost.
        if isinstance(args.exc_value, RuntimeError) and "Event loop is closed" in str(args.exc_value):
            log.debug("background checkpoint writer after its loop closed: %s", args.exc_value)
            return
        previous_unraisable(args)

    sys.unraisablehook = unraisable


def _drop_disk_full_records(record: logging.LogRecord) -> bool:
    err = record.exc_info[1] if record.exc_info else None
    if err is not None:
        return not Checkpoints._is_disk_full(err)
    return "No space left on device" not in record.getMessage()


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]
