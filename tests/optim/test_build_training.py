"""build_optimizer on the real model (micro tiny recipe): hyperball holds norms, Adam leaves roam, loss falls."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marinctl.model.loss import model_loss
from marinctl.model.transformer import init_model
from marinctl.optim import build_optimizer
from marinctl.optim.groups import norm_axes
from marinctl.optim.hyperball import initial_norms
from marinctl.params import param_table, tree_paths
from marinctl.routing.quantile_balance import router_bias

STEPS = 200


def synthetic_batches(recipe, steps: int) -> dict[str, np.ndarray]:
    """Arithmetic progressions (random start and stride 1-3, mod 48): learnable from the previous two tokens."""
    B, S = recipe.train.batch_size, recipe.train.seq_len
    rng = np.random.default_rng(0)
    start = rng.integers(0, 48, (steps, B, 1))
    stride = rng.integers(1, 4, (steps, B, 1))
    seq = (start + stride * np.arange(S + 1)) % 48 + 8
    ones = np.ones((steps, B, S))
    return {"tokens": seq[..., :-1], "targets": seq[..., 1:], "segment_ids": ones.astype(np.int32), "loss_mask": ones}


def flat(model) -> dict[str, np.ndarray]:
    return dict(zip(jax.tree.leaves(tree_paths(model)), map(np.asarray, jax.tree.leaves(model)), strict=True))


@pytest.fixture(scope="module")
def runs(micro_recipe):
    recipe = micro_recipe
    assert recipe.train.steps == STEPS
    model = init_model(recipe, jax.random.key(0))
    optimizer = build_optimizer(recipe, model)
    batches = synthetic_batches(recipe, STEPS)
    L, E = recipe.model.num_layers, recipe.moe.num_experts

    @jax.jit
    def step(model, opt_state, bias, batch, enabled):
        (loss, aux), grads = jax.value_and_grad(lambda m: model_loss(m, batch, bias, recipe), has_aux=True)(model)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        model = optax.apply_updates(model, jax.tree.map(lambda u: enabled * u, updates))
        return model, opt_state, router_bias(aux["beta"]), loss

    out = {"initial": flat(model)}
    for enabled in (1.0, 0.0):
        current, opt_state, bias, losses = model, optimizer.init(model), jnp.zeros((L, E)), []
        for i in range(STEPS):
            batch = {k: jnp.asarray(v[i]) for k, v in batches.items()}
            current, opt_state, bias, loss = step(current, opt_state, bias, batch, jnp.float32(enabled))
            losses.append(loss)  # no float(): keep dispatch asynchronous
            if enabled and i + 1 == 100:
                out["step_100"] = flat(current)
        out["losses" if enabled else "losses_disabled"] = np.asarray(jnp.stack(losses))
        if enabled:
            out["final"], out["opt_state"] = flat(current), opt_state
    return out


def norms(params: dict[str, np.ndarray], table) -> dict[str, np.ndarray]:
    return {
        k: np.sqrt(np.sum(np.float64(params[k]) ** 2, axis=norm_axes(spec)))
        for k, spec in table.items()
        if spec.group != "adam"
    }


def test_every_hyperball_matrix_keeps_its_initial_norm_per_scope_over_100_and_200_steps(runs, micro_recipe):
    table = param_table(micro_recipe)
    initial = norms(runs["initial"], table)
    assert len(initial) == sum(spec.group != "adam" for spec in table.values())
    for snapshot in ("step_100", "final"):
        now = norms(runs[snapshot], table)
        for k, n0 in initial.items():
            np.testing.assert_allclose(now[k], n0, rtol=1e-5, err_msg=f"{k} at {snapshot}")
            moved = np.linalg.norm(np.float64(runs[snapshot][k]) - runs["initial"][k]) / np.linalg.norm(n0)
            assert moved > 1e-2, f"{k} barely moved ({moved:.2e}) by {snapshot}"
    for k, n in initial_norms(runs["opt_state"]).items():  # the frozen norms the optimizer holds
        np.testing.assert_allclose(np.asarray(n), initial[k], rtol=1e-6, err_msg=k)


def test_adam_group_leaves_move_and_their_norms_are_free(runs, micro_recipe):
    for k, spec in param_table(micro_recipe).items():
        if spec.group == "adam":
            before, after = np.float64(runs["initial"][k]), np.float64(runs["final"][k])
            assert np.linalg.norm(after - before) > 1e-3 * max(np.linalg.norm(before), 1.0), k
            assert abs(np.linalg.norm(after) - np.linalg.norm(before)) > 1e-4 * max(np.linalg.norm(before), 1.0), k


def test_training_lowers_the_loss_far_below_the_same_run_with_updates_disabled(runs):
    trained, disabled = runs["losses"][-20:].mean(), runs["losses_disabled"][-20:].mean()
    assert disabled > 0.9 * np.log(64)  # nothing learned: about the uniform-prediction loss
    assert trained < 0.5 * disabled, (trained, disabled)
    assert runs["losses"][-20:].mean() < runs["losses"][:20].mean() - 1.0
