"""Checkpoints on a toy sharded state: async save/restore, keep policies, newest-valid resume, damage."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from marinctl.errors import UserError
from marinctl.recipe import CheckpointConfig
from marinctl.train.checkpoint import Checkpoints, flatten_state, save_due, unflatten_like


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))


def toy_state(mesh, value: float):
    row = NamedSharding(mesh, P("data"))
    rep = NamedSharding(mesh, P())
    return {
        "model": {"w": jax.device_put(jnp.full((16, 4), value, jnp.float32), row)},
        "opt_state": (jax.device_put(jnp.arange(16.0) * value, row), jax.device_put(jnp.int32(value), rep)),
        "step": jax.device_put(jnp.int32(value), rep),
    }


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def test_flatten_then_unflatten_is_identity_with_dotted_paths(mesh):
    state = toy_state(mesh, 2.0)
    flat = flatten_state(state)
    assert set(flat) == {"model.w", "opt_state.0", "opt_state.1", "step"}
    back = unflatten_like(state, flat)
    assert jax.tree.structure(back) == jax.tree.structure(state)


def test_async_save_restores_bitwise_with_the_target_shardings(mesh, tmp_path):
    ckpt = Checkpoints(tmp_path, CheckpointConfig(every=1, keep_last=3, async_save=True))
    state = toy_state(mesh, 3.0)
    ckpt.save(3, state, {"monitors": {"x": 1}})
    ckpt.wait()
    restored = ckpt.restore_latest(abstract(state))
    assert restored.step == 3 and restored.meta["monitors"] == {"x": 1}
    for key, leaf in flatten_state(state).items():
        got = restored.state[key]
        np.testing.assert_array_equal(np.asarray(got), np.asarray(leaf))
        assert got.sharding == leaf.sharding
    ckpt.close()


def test_async_save_is_unaffected_by_donating_the_saved_buffers_right_after(mesh, tmp_path):
    ckpt = Checkpoints(tmp_path, CheckpointConfig(every=1, async_save=True))
    state = toy_state(mesh, 5.0)
    expected = jax.tree.map(np.asarray, state)
    ckpt.save(1, state, {})
    clobber = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 1, s), donate_argnums=0)
    clobbered = clobber(state)  # the train step donates the state it was given
    jax.block_until_ready(clobbered)
    ckpt.wait()
    restored = ckpt.restore_latest(abstract(clobbered))
    for key, leaf in flatten_state(expected).items():
        np.testing.assert_array_equal(np.asarray(restored.state[key]), leaf)
    ckpt.close()


def test_keep_last_k_plus_every_m_policy(mesh, tmp_path):
    ckpt = Checkpoints(tmp_path, CheckpointConfig(every=1, keep_last=2, keep_every=4, async_save=True))
    state = toy_state(mesh, 1.0)
    for step in range(1, 11):
        ckpt.save(step, state, {})
    ckpt.wait()
    assert ckpt.steps() == [4, 8, 9, 10]
    ckpt.close()


def test_save_cadence_is_every_n_and_the_last_step():
    assert [s for s in range(1, 11) if save_due(s, 10, every=3)] == [3, 6, 9, 10]
    assert [s for s in range(1, 11) if save_due(s, 10, every=0)] == [10]


def test_half_written_checkpoint_is_ignored_and_damaged_newest_falls_back(mesh, tmp_path):
    ckpt = Checkpoints(tmp_path, CheckpointConfig(every=1, keep_last=5, async_save=False))
    for step in (1, 2):
        ckpt.save(step, toy_state(mesh, float(step)), {})
    ckpt.wait()
    ckpt.close()
    # A save killed mid-way leaves orbax's temporary directory, never a step directory.
    shutil.copytree(tmp_path / "2", tmp_path / "3.orbax-checkpoint-tmp-1234")
    # A step directory whose array data is damaged (disk trouble, a partial copy).
    shutil.copytree(tmp_path / "2", tmp_path / "4")
    shutil.rmtree(tmp_path / "4" / "state" / "d")
    ckpt = Checkpoints(tmp_path, CheckpointConfig(every=1, keep_last=5))
    assert 3 not in ckpt.steps()
    restored = ckpt.restore_latest(abstract(toy_state(mesh, 0.0)))
    assert restored.step == 2 and restored.skipped == (4,)
    np.testing.assert_array_equal(np.asarray(restored.state["model.w"]), np.full((16, 4), 2.0))
    ckpt.close()


def test_checkpoint_from_another_recipe_is_a_user_error_naming_the_leaf(mesh, tmp_path):
    ckpt = Checkpoints(tmp_path, CheckpointConfig(every=1))
    ckpt.save(1, toy_state(mesh, 1.0), {})
    ckpt.wait()
    other = toy_state(mesh, 1.0)
    other["model"]["w"] = jax.device_put(jnp.zeros((16, 8)), NamedSharding(mesh, P("data")))
    with pytest.raises(UserError, match=r"model\.w"):
        ckpt.restore_latest(abstract(other))
    ckpt.close()


def test_empty_directory_restores_nothing(mesh, tmp_path):
    ckpt = Checkpoints(tmp_path / "new", CheckpointConfig())
    assert ckpt.restore_latest(abstract(toy_state(mesh, 0.0))) is None
    ckpt.close()
