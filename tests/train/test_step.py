"""The train step in isolation: a non-finite step changes nothing but the counters; a finite one
updates the model and replaces the router bias from the QB estimate (docs/recipe.md §3.5)."""

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


def test_guarded_update_equals_the_per_leaf_select_it_replaced_and_copies_no_optimizer_state(setup):
    """The step applies the update under `lax.cond(finite, ...)`; the path it replaced selected every leaf with
    `where(finite, new, old)`. Both give the same state after a finite step, and the compiled step no longer
    copies optimizer-state buffers (the select kept each donated old buffer alive, so XLA copied it)."""
    import re

    import equinox as eqx
    import jax.numpy as jnp

    from marinctl.routing.quantile_balance import router_bias
    from marinctl.train.step import gradient_norms, loss_and_grads

    recipe, mesh, step, fresh, rows, host = setup
    optimizer = make_optimizer(recipe)

    def where_path(state, batch):
        loss, aux, grads = loss_and_grads(state.model, batch, state.router_bias, recipe)
        finite = jnp.isfinite(loss) & jnp.isfinite(gradient_norms(grads)["grad_norm"])
        updates, opt_state = optimizer.update(grads, state.opt_state, state.model)
        model = eqx.apply_updates(state.model, updates)

        def keep(new, old):
            return jnp.where(finite, new, old)

        return (
            jax.tree.map(keep, model, state.model),
            jax.tree.map(keep, opt_state, state.opt_state),
            keep(router_bias(aux["beta"]), state.router_bias),
        )

    with jax.set_mesh(mesh):
        batch = device_batch(host, rows, recipe.train.batch_size)
        want = jax.device_get(jax.jit(where_path)(fresh(), batch))
        got, _ = step(fresh(), batch)
        got = jax.device_get((got.model, got.opt_state, got.router_bias))
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    # No buffer of the donated state is copied any more (the select path copied 30 here, one per optimizer leaf).
    hlo = step.as_text()
    entry = hlo[hlo.index("\nENTRY") :].split("\n}\n")[0]
    parameters = set(re.findall(r"%([\w.\-]+) = \S+ parameter\(\d+\)", entry))
    assert len(parameters) > 10
    copied = [m[1] for m in re.finditer(r"= \S+ copy\(%([\w.\-]+)\)", hlo) if m[1] in parameters]
    assert not copied
