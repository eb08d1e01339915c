"""The mesh and sharding rules on 8 simulated CPU devices."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

from marinctl.errors import UserError
from marinctl.params import param_table, partition_spec
from marinctl.recipe import ParallelConfig
from marinctl.routing.mesh import batch_sharding, make_mesh, param_shardings


@pytest.mark.parametrize(
    ("parallel", "shape"),
    [
        (ParallelConfig(replica=1, data=-1, expert=1), (1, 8, 1)),
        (ParallelConfig(replica=1, data=2, expert=-1), (1, 2, 4)),
        (ParallelConfig(replica=2, data=1, expert=4), (2, 1, 4)),
        (ParallelConfig(replica=1, data=1, expert=8), (1, 1, 8)),
    ],
)
def test_mesh_axes_and_sizes_follow_the_recipe_with_expert_innermost(parallel, shape):
    mesh = make_mesh(parallel)
    assert mesh.axis_names == ("replica", "data", "expert")
    assert tuple(mesh.shape.values()) == shape
    # expert is the fastest-varying axis over the device order: one expert group = consecutive devices
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    np.testing.assert_array_equal(ids.reshape(-1), [d.id for d in jax.devices()])


def test_a_mesh_that_does_not_fit_the_devices_is_a_user_error():
    with pytest.raises(UserError, match="parallel: "):
        make_mesh(ParallelConfig(replica=1, data=3, expert=-1))
    with pytest.raises(UserError, match="needs 16 devices"):
        make_mesh(ParallelConfig(replica=2, data=2, expert=4))


def test_expert_weights_shard_over_expert_and_the_rest_fsdp(tiny_recipe):
    mesh = make_mesh(ParallelConfig(replica=1, data=2, expert=4))
    table = param_table(tiny_recipe)
    abstract = {}
    for path, spec in table.items():  # nested dicts give the same dotted paths as the model tree
        node = abstract
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = jax.ShapeDtypeStruct(spec.shape, np.float32)
    shardings = param_shardings(abstract, tiny_recipe, mesh)
    for path, spec in table.items():  # every leaf found by its path, placed by the one rule
        node = shardings
        for part in path.split("."):
            node = node[part]
        assert node.spec == PartitionSpec(*partition_spec(spec, dict(mesh.shape))), path
    experts = shardings["blocks"]["moe"]["experts"]["w_gate"]  # [L, E, l, I]
    assert experts.spec == PartitionSpec(None, "expert", "data", None)
    assert shardings["blocks"]["attention"]["w_q"].spec[0] is None  # layers are never sharded (scan)
    assert ("data", "expert") in tuple(shardings["embed"]["weight"].spec)  # FSDP over data x expert
    with pytest.raises(ValueError, match="parameter table says"):
        param_shardings({"embed": {"weight": jax.ShapeDtypeStruct((3, 3), np.float32)}}, tiny_recipe, mesh)


def test_batch_rows_are_split_over_every_mesh_axis():
    mesh = make_mesh(ParallelConfig(replica=2, data=1, expert=4))
    sharding = batch_sharding(mesh)
    assert sharding.spec == PartitionSpec(("replica", "data", "expert"))
    batch = jax.device_put(np.arange(16 * 3).reshape(16, 3), sharding)
    assert {s.data.shape for s in batch.addressable_shards} == {(2, 3)}
