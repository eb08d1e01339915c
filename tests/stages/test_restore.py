"""marinctl/restore.py: a checkpoint's model and router bias, read back without touching the run."""

import dataclasses
import shutil

import numpy as np
import orbax.checkpoint as ocp
import pytest

from marinctl.errors import UserError
from marinctl.params import param_table, partition_spec
from marinctl.restore import checkpoint_steps, restore_weights, run_recipe_path


def stored_state(run_dir, step):
    """Oracle: the whole saved train state, read with plain orbax."""
    restored = ocp.StandardCheckpointer().restore((run_dir / "checkpoints" / str(step) / "state").absolute())
    return {k: np.asarray(v) for k, v in restored.items()}


def test_newest_checkpoint_restores_exactly_the_saved_model_and_router_bias(trained_run):
    recipe, run_dir = trained_run
    weights = restore_weights(recipe, run_dir)
    assert weights.step == 2 == checkpoint_steps(run_dir / "checkpoints")[-1]
    saved = stored_state(run_dir, 2)
    assert set(weights.params) == set(param_table(recipe))
    for path, value in weights.params.items():
        assert isinstance(value, np.ndarray)
        np.testing.assert_array_equal(value, saved[f"model.{path}"])
    np.testing.assert_array_equal(weights.router_bias, saved["router_bias"])
    assert np.any(saved["router_bias"] != 0)  # QB ran: the bias is a real, step-specific tensor


def test_restore_on_a_mesh_lays_each_parameter_out_by_the_table_rule(trained_run):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from marinctl.routing.mesh import make_mesh

    recipe, run_dir = trained_run
    mesh = make_mesh(recipe.parallel)
    weights = restore_weights(recipe, run_dir, step=1, mesh=mesh)
    saved, table, sizes = stored_state(run_dir, 1), param_table(recipe), dict(mesh.shape)
    assert sizes == {"replica": 1, "data": 4, "expert": 2}
    for path, value in weights.params.items():
        assert isinstance(value, jax.Array)
        assert value.sharding.is_equivalent_to(
            NamedSharding(mesh, PartitionSpec(*partition_spec(table[path], sizes))), value.ndim
        )
        np.testing.assert_array_equal(np.asarray(value), saved[f"model.{path}"])
    assert weights.router_bias.sharding.is_fully_replicated


def test_restore_leaves_the_run_dir_untouched_even_an_unfinished_save(trained_run):
    recipe, run_dir = trained_run
    # What a live run's in-flight save looks like; the trainer's own manager would delete it on open.
    in_flight = run_dir / "checkpoints" / "3.orbax-checkpoint-tmp-123"
    in_flight.mkdir()
    try:
        before = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
        assert checkpoint_steps(run_dir / "checkpoints") == [1, 2]
        restore_weights(recipe, run_dir)
        after = sorted((p.relative_to(run_dir), p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
        assert after == before
    finally:
        in_flight.rmdir()


def test_a_step_without_checkpoint_is_a_user_error_naming_the_available_steps(trained_run):
    recipe, run_dir = trained_run
    with pytest.raises(UserError, match=r"no checkpoint at step 7 \(available: 1, 2\)"):
        restore_weights(recipe, run_dir, step=7)


def test_a_recipe_whose_model_differs_from_the_checkpoint_is_a_user_error_naming_the_leaf(trained_run):
    recipe, run_dir = trained_run
    wider = recipe.replace(moe=dataclasses.replace(recipe.moe, num_experts=16))
    with pytest.raises(
        UserError, match=r"'model.blocks.moe.router' is float32\[2, 64, 8\], the recipe needs float32\[2, 64, 16\]"
    ):
        restore_weights(wider, run_dir)


def test_a_run_dir_without_recipe_or_checkpoints_is_a_user_error(trained_run, tmp_path):
    recipe, run_dir = trained_run
    with pytest.raises(UserError, match="no such run directory"):
        run_recipe_path(tmp_path / "missing")
    with pytest.raises(UserError, match=r"no recipe\.toml"):
        run_recipe_path(tmp_path)
    shutil.copy(run_dir / "recipe.toml", tmp_path / "recipe.toml")
    assert run_recipe_path(tmp_path) == tmp_path / "recipe.toml"
    with pytest.raises(UserError, match="no checkpoint in"):
        restore_weights(recipe, tmp_path)
    assert not (tmp_path / "checkpoints").exists()  # looking did not create it
