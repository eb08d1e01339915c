"""The device mesh and sharding rules (docs/recipe.md §4; issue 7): axes ("replica", "data", "expert").

`expert` is innermost so the expert-parallel all-to-alls stay among neighbouring devices (the hero's
64-way expert axis inside one GB200 NVL72 rack), `data` is FSDP inside a replica, and `replica` is plain
data parallelism across racks over the data-centre network. Parameter placement is the one rule in
`marinctl.params.partition_spec`; this module only turns it into `NamedSharding`s.

Axis types are Auto: the model is written global-view and left to the partitioner, with the MoE in an
explicit `shard_map` (marinctl/routing/transports.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from marinctl.errors import UserError
from marinctl.params import MESH_AXES, param_table, partition_spec, path_str, resolve_mesh_shape, spec_for
from marinctl.recipe import ParallelConfig, Recipe


def make_mesh(parallel: ParallelConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The ("replica", "data", "expert") mesh over `devices` (default: all), sizes from the recipe.

    When the devices report distinct `slice_index` values (TPU slices, GPU NVLink domains) and there are
    as many slices as replicas, each replica is exactly one slice, so no expert or FSDP collective
    leaves a slice. Otherwise devices are laid out in their global order, which puts consecutive
    devices (one host, then its neighbours) on the expert axis.
    """
    devices = list(jax.devices() if devices is None else devices)
    try:
        sizes = resolve_mesh_shape(parallel, len(devices))
    except ValueError as err:
        raise UserError(f"parallel: {err}") from None
    shape = tuple(sizes[a] for a in MESH_AXES)
    slices = {getattr(d, "slice_index", 0) for d in devices}
    if len(slices) > 1 and len(slices) == sizes["replica"]:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_hybrid_device_mesh(
            (1, sizes["data"], sizes["expert"]), (sizes["replica"], 1, 1), devices
        )
    else:
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def param_shardings(tree, recipe: Recipe, mesh: Mesh):
    """A pytree like `tree` (model or its abstract shapes) of `NamedSharding`s from the parameter table."""
    table = param_table(recipe)
    sizes = dict(mesh.shape)

    def sharding(path, leaf) -> NamedSharding:
        spec = spec_for(path_str(path), table)
        if tuple(leaf.shape) != spec.shape:
            raise ValueError(f"{path_str(path)}: shape {tuple(leaf.shape)} but the parameter table says {spec.shape}")
        return NamedSharding(mesh, PartitionSpec(*partition_spec(spec, sizes)))

    return jax.tree_util.tree_map_with_path(sharding, tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch rows over every mesh axis: each device holds distinct sequences (the MoE's token layout)."""
    return NamedSharding(mesh, PartitionSpec(tuple(a for a in MESH_AXES if a in mesh.axis_names)))
