"""Launch checks: the dry run (full-size state and shardings, shapes only) and the fail-fast fit check.

`dry_run` builds the model and optimizer state abstractly (`jax.eval_shape`: nothing is allocated),
places them on an abstract mesh of the recipe's size (`jax.sharding.AbstractMesh`), checks that every
sharded dimension divides, and reports exact per-device parameter and optimizer bytes beside the
planner's estimate of gradients, activations and MoE buffers. It runs for the hero on a laptop.
`check_fits` is the same arithmetic against the devices actually present, before anything is allocated.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType

from marinctl.counting import memory_estimate
from marinctl.errors import UserError
from marinctl.params import MESH_AXES, recipe_device_count, resolve_mesh_shape
from marinctl.recipe import Recipe

GiB = 2**30

log = logging.getLogger(__name__)


def mesh_sizes(recipe: Recipe, n_devices: int) -> dict[str, int]:
    """The mesh for `n_devices`, or a user error with the mesh the recipe needs and its memory figures."""
    try:
        return resolve_mesh_shape(recipe.parallel, n_devices)
    except ValueError as err:
        needed = recipe_device_count(recipe.parallel)
        figures = ""
        if needed:
            mem = memory_estimate(recipe, resolve_mesh_shape(recipe.parallel, needed))
            figures = f"; on its own mesh it needs {_per_device(mem)} per device"
        raise UserError(
            f"{recipe.source}: parallel: {err}{figures} (check with `marinctl train {recipe.source} --dry-run`)"
        ) from None


def _per_device(mem: Any) -> str:
    return (
        f"{mem.total / GiB:.2f} GiB (params {mem.params / GiB:.2f} + optimizer {mem.optimizer / GiB:.2f} "
        f"+ grads {mem.gradients / GiB:.2f} + activations {mem.activations / GiB:.2f} "
        f"+ MoE buffers {mem.moe_buffers / GiB:.2f})"
    )


def check_batch_divides(
    recipe: Recipe, n_devices: int, process_count: int, where: str | None = None, first_seq_len: int | None = None
) -> None:
    """Every device must get whole rows of every micro-batch and eval batch, every host whole rows.
    `where` names what set the rows in the message (default: the recipe's file); `first_seq_len` is the
    run's first context, for a segment the schedule re-derived (`check_eval_rows`)."""
    where = where or recipe.source
    t = recipe.train
    micro = t.batch_size // t.grad_accum
    if micro % n_devices:
        raise UserError(
            f"{where}: train.batch_size: {t.batch_size} / grad_accum {t.grad_accum} = {micro} rows per "
            f"micro-batch do not split over {n_devices} devices"
        )
    check_eval_rows(recipe, n_devices, where, first_seq_len)
    if t.batch_size % process_count or recipe.eval_rows % process_count:
        raise UserError(f"{where}: train/eval batch sizes do not split over {process_count} processes")


def check_eval_rows(recipe: Recipe, n_devices: int, where: str | None = None, first_seq_len: int | None = None) -> None:
    """Every device must get whole rows of every eval batch (`marinctl eval` needs only this half). An
    explicit `eval.batch_size` holds its tokens, not its rows, across a context change: the message says
    so only where the context differs from the run's first (`first_seq_len`)."""
    rows = recipe.eval_rows
    if recipe.eval.sources and rows % n_devices:
        seq_len = recipe.train.seq_len
        changed = first_seq_len is not None and first_seq_len != seq_len
        why = " (a context change keeps eval tokens per batch)" if changed else ""
        at = f" at seq_len {seq_len}{why}" if recipe.eval.batch_size else ""
        raise UserError(
            f"{where or recipe.source}: eval.batch_size: {rows} rows{at} do not split over {n_devices} devices"
        )


def device_memory_bytes(device: Any, local_devices: int) -> int | None:
    """Memory one device may use: the accelerator's limit, or on CPU the host's RAM over its devices."""
    try:
        stats = device.memory_stats()
    except Exception:  # not implemented by every backend
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    if device.platform == "cpu":
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(local_devices, 1)
        except (ValueError, OSError):
            return None
    return None


def check_fits(recipe: Recipe, devices: list[Any]) -> dict[str, int]:
    """Fail fast (exit 2, nothing allocated) when the recipe's mesh does not fit `devices`, or when its
    exactly known state (parameters, optimizer state, gradients) alone exceeds a device's memory. The
    activation and MoE-buffer figures are estimates, so exceeding memory with them only warns."""
    sizes = mesh_sizes(recipe, len(devices))
    mem = memory_estimate(recipe, sizes)
    local = [d for d in devices if d.process_index == jax.process_index()]
    capacity = device_memory_bytes(local[0], len(local))
    if capacity is None:
        return sizes
    mesh = " x ".join(f"{a}={sizes[a]}" for a in MESH_AXES)
    here = f"a {local[0].platform} device here has {capacity / GiB:.2f} GiB"
    if mem.params + mem.optimizer + mem.gradients > capacity:
        raise UserError(
            f"{recipe.source}: needs {_per_device(mem)} per device on mesh {mesh}, but {here}; "
            "use more devices (parallel.*) or a smaller recipe"
        )
    if mem.total > capacity:
        log.warning("%s: estimated %s per device on mesh %s, but %s", recipe.source, _per_device(mem), mesh, here)
    return sizes


def abstract_mesh(sizes: dict[str, int]) -> AbstractMesh:
    return AbstractMesh(tuple(sizes[a] for a in MESH_AXES), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def dry_run(recipe: Recipe, n_devices: int | None = None, *, compile_step: bool = False) -> dict[str, Any]:
    """Shapes-only build of the full state on the recipe's mesh: divisibility, exact and estimated bytes;
    with `compile_step`, also XLA's memory analysis of the compiled step (`compiled_memory`)."""
    from marinctl.train.checkpoint import flatten_state
    from marinctl.train.state import abstract_state, make_optimizer, state_shardings

    n = n_devices or recipe_device_count(recipe.parallel)
    if n is None:
        raise UserError(f"{recipe.source}: parallel has a -1 (fill) axis: give the device count with --devices N")
    sizes = mesh_sizes(recipe, n)
    check_batch_divides(recipe, n, 1)
    optimizer = make_optimizer(recipe)
    abstract = abstract_state(recipe, optimizer)
    shardings = state_shardings(recipe, optimizer, abstract_mesh(sizes))
    leaves, problems = flatten_state(abstract), []
    sharding_of = flatten_state(shardings)
    per_device = {"model": 0, "opt_state": 0, "other": 0}
    total_bytes = 0
    for path, leaf in leaves.items():
        spec = sharding_of[path].spec
        for dim, axes in zip(leaf.shape, tuple(spec) + (None,) * (len(leaf.shape) - len(spec)), strict=True):
            names = (axes,) if isinstance(axes, str) else tuple(axes or ())
            ways = math.prod(sizes[a] for a in names)
            if dim % ways:
                problems.append(f"{path}: dim {dim} over {'x'.join(names)}={ways}")
        shard = sharding_of[path].shard_shape(leaf.shape)
        nbytes = math.prod(shard) * np.dtype(leaf.dtype).itemsize
        group = path.split(".", 1)[0]
        per_device[group if group in per_device else "other"] += nbytes
        total_bytes += math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
    if problems:
        raise UserError(f"{recipe.source}: {len(problems)} leaves do not divide over the mesh, e.g. {problems[0]}")
    estimate = memory_estimate(recipe, sizes)
    exact = {"params": per_device["model"], "optimizer": per_device["opt_state"], "other_state": per_device["other"]}
    parts = {k: v for k, v in estimate.parts.items() if k not in ("params", "optimizer")}
    report: dict[str, Any] = {
        "recipe": recipe.name,
        "devices": n,
        "mesh": sizes,
        "leaves": len(leaves),
        "state_bytes_total": total_bytes,
        # exact state bytes, then the planner's components at the step's peak (GPU: the recipe's target)
        "per_device_bytes": exact | parts | {"total": sum(exact.values()) + sum(parts.values())},
        # beside the device peak, not in it: what the step keeps in the host's pinned memory per device
        "host_bytes_per_device": {k: v for k, v in estimate.host.items() if v},
        "planner_estimate": estimate.as_dict(),
    }
    segs = schedule_segments(recipe, sizes)
    if len(segs) > 1:
        report["segments"] = segs
    if compile_step:
        report["compiled"] = compiled_memory(recipe, sizes)
    return report


def schedule_segments(recipe: Recipe, sizes: dict[str, int]) -> list[dict[str, Any]]:
    """The planner's peak for every stretch of `[[schedule.changes]]` (a transport or context switch
    changes the buffers): the run fits only if each one does."""
    from marinctl.schedule import segments

    out = []
    for seg in segments(recipe):
        est = memory_estimate(seg.recipe, sizes)
        out.append(
            {
                "start_step": seg.start,
                "labels": list(seg.labels),
                "seq_len": seg.recipe.train.seq_len,
                "transport": seg.recipe.moe.transport,
                "total": est.total,
                "host": sum(est.host.values()),
                "peak_phase": est.peak_phase,
            }
        )
    return out


def compile_plan(recipe: Recipe, sizes: dict[str, int]) -> tuple[Recipe, dict[str, int]]:
    """The recipe and mesh `--compile` builds. Parameters are never sharded over `replica` (plain data
    parallelism), so folding the replicas into one, with the batch divided by them, gives every device
    exactly the shapes it has on the full mesh: the hero's 704-device step compiles on 64 devices."""
    replica = sizes["replica"]
    if replica == 1 or recipe.train.batch_size % replica:
        return recipe, sizes
    folded = dataclasses.replace(
        recipe,
        parallel=dataclasses.replace(recipe.parallel, replica=1),
        train=dataclasses.replace(recipe.train, batch_size=recipe.train.batch_size // replica),
    )
    return folded, sizes | {"replica": 1}


def compile_device_count(recipe: Recipe, n_devices: int | None = None) -> int:
    """Devices `--compile` needs: the recipe's mesh with its replicas folded (see `compile_plan`)."""
    n = n_devices or recipe_device_count(recipe.parallel)
    if n is None:
        raise UserError(f"{recipe.source}: parallel has a -1 (fill) axis: give the device count with --devices N")
    return math.prod(compile_plan(recipe, mesh_sizes(recipe, n))[1].values())


def ensure_host_devices(n: int) -> None:
    """Ask XLA for `n` simulated CPU devices, unless the environment already chose a count. Only the host
    platform reads this flag (a GPU run is unaffected), and only before JAX starts its backends."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def compiled_memory(recipe: Recipe, sizes: dict[str, int]) -> dict[str, Any]:
    """Compile the real sharded train step for abstract arguments (nothing is allocated) and return XLA's
    `memory_analysis()` per device beside the planner's estimate for the same platform and mesh.

    XLA's peak is arguments + outputs − aliased (the donated state is updated in place) + temporaries;
    its host temporaries (offloaded remat saves on a GPU) sit beside it, as the planner's `host` does.
    On CPU the step compiles with the CPU's choices (fp32 for compute_dtype "auto", the XLA attention
    path), and the planner is asked about exactly that program, so the two figures are comparable.
    """
    import time

    from marinctl.routing.mesh import batch_sharding, make_mesh
    from marinctl.train.state import make_optimizer, state_shardings
    from marinctl.train.step import compile_train_step

    run_recipe, run_sizes = compile_plan(recipe, sizes)
    n = math.prod(run_sizes.values())
    devices = jax.devices()
    if len(devices) < n:
        raise UserError(
            f"{recipe.source}: --compile needs {n} devices, {len(devices)} present "
            f"(on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n})"
        )
    platform = "gpu" if devices[0].platform in ("gpu", "cuda", "rocm") else "cpu"
    mesh = make_mesh(run_recipe.parallel, devices[:n])
    optimizer = make_optimizer(run_recipe)
    start = time.perf_counter()
    with jax.set_mesh(mesh):
        shardings = state_shardings(run_recipe, optimizer, mesh)
        compiled = compile_train_step(run_recipe, optimizer, shardings, batch_sharding(mesh))
    seconds = time.perf_counter() - start
    stats = compiled.memory_analysis()
    xla = {
        "argument": int(stats.argument_size_in_bytes),
        "output": int(stats.output_size_in_bytes),
        "alias": int(stats.alias_size_in_bytes),
        "temp": int(stats.temp_size_in_bytes),
        "generated_code": int(stats.generated_code_size_in_bytes),
        # host memory space (model.remat = "offload"): XLA:CPU lowers host placement as a no-op, so 0 there
        "host_temp": int(getattr(stats, "host_temp_size_in_bytes", 0)),
        "host_argument": int(getattr(stats, "host_argument_size_in_bytes", 0)),
        "host_output": int(getattr(stats, "host_output_size_in_bytes", 0)),
    }
    xla["peak"] = xla["argument"] + xla["output"] - xla["alias"] + xla["temp"]
    planner = memory_estimate(run_recipe, run_sizes, platform=platform)
    return {
        "platform": devices[0].platform,
        "devices": n,
        "mesh": run_sizes,
        "replicas_folded": sizes["replica"] if run_sizes is not sizes else 1,
        "compile_seconds": round(seconds, 2),
        "xla_bytes": xla,
        "planner_bytes": planner.as_dict(),
        "difference": planner.total / xla["peak"] - 1.0 if xla["peak"] else None,
    }
