"""The train step in isolation: a non-finite step changes nothing but the counters; a finite one
updates the model and replaces the router bias from the QB estimate (SPEC 3.5)."""

import jax
import numpy as np
import pytest

from marinctl.data.loader import Loader
from marinctl.recipe import load_recipe
from marinctl.routing.mesh import batch_sharding, make_mesh
from marinctl.train.state import init_state, make_optimizer, state_shardings
from marinctl.train.step import compile_train_step, device_batch


@pytest.fixture(scope="module")
def setup(micro_recipe_path):
    recipe = load_recipe(micro_recipe_path)
    mesh = make_mesh(recipe.parallel)
    optimizer = make_optimizer(recipe)
    shardings = state_shardings(recipe, optimizer, mesh)
    rows = batch_sharding(mesh)
    with jax.set_mesh(mesh):
        step = compile_train_step(recipe, optimizer, shardings, rows)
        fresh = jax.jit(lambda: init_state(recipe, optimizer), out_shardings=shardings)
    return recipe, mesh, step, fresh, rows, Loader(recipe).batch(0)


def test_nonfinite_step_keeps_model_optimizer_and_bias_bitwise_and_counts_it(setup):
    recipe, mesh, step, fresh, rows, host = setup
    poisoned = {**host, "loss_mask": np.full_like(host["loss_mask"], np.nan)}
    with jax.set_mesh(mesh):
        state = fresh()
        before = jax.device_get(state)  # the step donates `state`
        after, metrics = step(state, device_batch(poisoned, rows, recipe.train.batch_size))
        after = jax.device_get(after)
    assert not bool(metrics["finite"])
    assert int(after.step) == 1 and int(after.nonfinite_skipped) == 1
    for name in ("model", "opt_state", "router_bias"):
        for a, b in zip(jax.tree.leaves(getattr(before, name)), jax.tree.leaves(getattr(after, name)), strict=True):
            np.testing.assert_array_equal(a, b)


def test_finite_step_updates_the_model_and_replaces_the_router_bias_with_centred_qb_values(setup):
    recipe, mesh, step, fresh, rows, host = setup
    with jax.set_mesh(mesh):
        state = fresh()
        before = jax.device_get(state)
        after, metrics = step(state, device_batch(host, rows, recipe.train.batch_size))
        after = jax.device_get(after)
    assert bool(metrics["finite"]) and int(after.nonfinite_skipped) == 0
    assert not np.array_equal(before.model.lm_head.weight, after.model.lm_head.weight)
    bias = np.asarray(after.router_bias)
    assert bias.shape == (recipe.model.num_layers, recipe.moe.num_experts)
    np.testing.assert_allclose(bias.mean(axis=-1), 0.0, atol=1e-6)  # b = -(β - mean β)
    assert np.abs(bias).max() > 0


def test_grad_accumulation_equals_the_full_batch_loss_and_gradient(micro_recipe_path):
    """Dropless routing is per token, so two token-weighted micro-batches must give the full batch's
    loss and gradient (QB's β is an average of the micro-batches' estimates, not compared)."""
    import dataclasses

    from marinctl.model.transformer import init_model
    from marinctl.train.step import loss_and_grads

    base = load_recipe(micro_recipe_path, ["moe.transport=dense", "parallel.expert=1"])
    host = Loader(base).batch(0)
    host["loss_mask"][: len(host["loss_mask"]) // 2, ::3] = 0.0  # micro-batches with unequal token counts
    mesh = make_mesh(base.parallel, jax.devices()[:2])
    results = []
    with jax.set_mesh(mesh):
        model = init_model(base, jax.random.key(0))
        bias = jax.numpy.zeros((base.model.num_layers, base.moe.num_experts))
        batch = device_batch(host, batch_sharding(mesh), base.train.batch_size)
        for accum in (1, 2):
            recipe = base.replace(train=dataclasses.replace(base.train, grad_accum=accum))
            loss, aux, grads = jax.jit(lambda m, b, r=recipe: loss_and_grads(m, b, bias, r))(model, batch)
            results.append(jax.device_get((loss, aux, grads)))
    (loss1, aux1, g1), (loss2, aux2, g2) = results
    np.testing.assert_allclose(loss2, loss1, rtol=1e-6)
    np.testing.assert_allclose(aux2["ce"], aux1["ce"], rtol=1e-6)
    np.testing.assert_array_equal(aux2["expert_load"], aux1["expert_load"])
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-7)
