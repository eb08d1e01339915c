"""build_optimizer (marinctl/optim/build.py): every group's update against numpy, sharding, checkpointing."""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from marinctl.counting import optimizer_state_elems
from marinctl.hparams import hyperparams, lr_multiplier
from marinctl.optim import build_optimizer, optimizer_state_shardings
from marinctl.optim.groups import norm_axes
from marinctl.optim.muon import coefficient_schedule
from marinctl.params import param_table, partition_spec, path_str


@pytest.fixture(scope="module")
def recipe(micro_recipe):
    # 10 steps: step 0 is warmup (LR 0), steps 1-2 decay from the peak; weight decay on to be checked.
    return micro_recipe.replace(
        train=dataclasses.replace(micro_recipe.train, steps=10),
        optimizer=dataclasses.replace(micro_recipe.optimizer, weight_decay=0.5),
    )


@pytest.fixture(scope="module")
def params(recipe):
    rng = np.random.default_rng(0)
    return {p: jnp.asarray(0.1 * rng.standard_normal(s.shape), jnp.float32) for p, s in param_table(recipe).items()}


@pytest.fixture(scope="module")
def grads(params):
    rng = np.random.default_rng(1)
    return [{p: jnp.asarray(rng.standard_normal(v.shape), jnp.float32) for p, v in params.items()} for _ in range(3)]


def numpy_newton_schulz(u: np.ndarray, coefficients) -> np.ndarray:
    """Per matrix in the last two axes, written as loops over the leading ones."""
    out = np.empty_like(u)
    for index in np.ndindex(u.shape[:-2]):
        x = u[index] / (np.sqrt(np.sum(u[index] ** 2)) + 1e-8)
        wide = x.shape[0] <= x.shape[1]
        x = x if wide else x.T
        for a, b, c in coefficients:
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        out[index] = x if wide else x.T
    return out


def numpy_optimizer(recipe, params, grads) -> dict[str, np.ndarray]:
    """docs/recipe.md §5 step by step in float64: Adam(+WD) / AdamH / MuonH, hyperball norms frozen at init."""
    hp, o = hyperparams(recipe), recipe.optimizer
    table = param_table(recipe)
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    n0 = {k: np.sqrt(np.sum(p[k] ** 2, axis=norm_axes(s), keepdims=True)) for k, s in table.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, g in enumerate(grads):
        g = {k: np.asarray(x, np.float64) for k, x in g.items()}
        mult = lr_multiplier(t, hp.warmup_steps, hp.steps, hp.final_lr_fraction)
        for k, spec in table.items():
            if spec.group == "muonh":
                m[k] = o.muon_momentum * m[k] + g[k]
                u = numpy_newton_schulz(o.muon_momentum * m[k] + g[k], coefficient_schedule("tuned", 5))
            else:
                m[k] = hp.beta1 * m[k] + (1 - hp.beta1) * g[k]
                v[k] = hp.beta2 * v[k] + (1 - hp.beta2) * g[k] ** 2
                m_hat, v_hat = m[k] / (1 - hp.beta1 ** (t + 1)), v[k] / (1 - hp.beta2 ** (t + 1))
                u = m_hat / (np.sqrt(v_hat) + hp.epsilon)
            if spec.group == "adam":
                decay = 0.0
                if k in ("blocks.attention.w_gate", "blocks.moe.router"):
                    decay = o.weight_decay * hp.adam_lr * (1 - t / (hp.steps - 1))
                p[k] = p[k] - hp.adam_lr * mult * u - decay * p[k]
            else:
                lr = (hp.muonh_lr if spec.group == "muonh" else hp.adamh_lr) * mult
                axes = norm_axes(spec)
                moved = p[k] - lr * n0[k] * u / np.maximum(np.sqrt(np.sum(u * u, axis=axes, keepdims=True)), 1e-10)
                p[k] = n0[k] * moved / np.sqrt(np.sum(moved * moved, axis=axes, keepdims=True))
    return p


def run(optimizer, params, grads):
    state = optimizer.init(params)

    @jax.jit
    def step(p, s, g):
        updates, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, updates), s

    for g in grads:
        params, state = step(params, state, g)
    return params, state


@pytest.fixture(scope="module")
def three_steps(recipe, params, grads):
    """(optimizer, parameters, state) after three steps on one device: one compile for the tests below."""
    optimizer = build_optimizer(recipe, params)
    return optimizer, *run(optimizer, params, grads)


def test_three_steps_of_every_group_equal_a_numpy_implementation(recipe, params, grads, three_steps):
    _, trained, _ = three_steps
    assert hyperparams(recipe).warmup_steps == 1  # step 0 at LR 0, then the decay: both parts exercised
    expected = numpy_optimizer(recipe, params, grads)
    for k in params:
        np.testing.assert_allclose(np.asarray(trained[k]), expected[k], atol=1e-5, rtol=1e-4, err_msg=k)
        assert not np.allclose(np.asarray(trained[k]), np.asarray(params[k]), atol=1e-7), f"{k} did not move"


def test_weight_decay_touches_only_the_attention_gate_and_router(recipe, params):
    # Zero gradients: Adam's direction is 0, so only weight decay can move a leaf.
    adam = {k: params[k] for k, s in param_table(recipe).items() if s.group == "adam"}
    got, _ = run(build_optimizer(recipe, adam), adam, [jax.tree.map(jnp.zeros_like, adam)] * 2)
    hp = hyperparams(recipe)
    for k in adam:
        if k in ("blocks.attention.w_gate", "blocks.moe.router"):
            shrink = (1 - 0.5 * hp.adam_lr) * (1 - 0.5 * hp.adam_lr * (1 - 1 / 9))
            np.testing.assert_allclose(np.asarray(got[k]), shrink * np.asarray(params[k]), rtol=1e-6)
        else:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(params[k]))


def test_grad_clip_rescales_gradients_by_their_global_norm_before_every_group(recipe, params, grads):
    subset = {k: params[k] for k in ("blocks.moe.router", "lm_head.weight", "blocks.attention.w_o")}
    g = [{k: x[k] for k in subset} for x in grads[:2]]
    g[1] = jax.tree.map(lambda x: 1e3 * x, g[1])  # one step far above the clip, one below
    clipped = recipe.replace(optimizer=dataclasses.replace(recipe.optimizer, grad_clip=1000.0))
    got, _ = run(build_optimizer(clipped, subset), subset, g)
    norms = [float(np.sqrt(sum(np.sum(np.float64(x) ** 2) for x in step.values()))) for step in g]
    assert norms[0] < 1000.0 < norms[1]
    scales = [min(1.0, 1000.0 / n) for n in norms]
    pre_clipped = [jax.tree.map(lambda x, c=c: c * x, step) for step, c in zip(g, scales, strict=True)]
    expected, _ = run(build_optimizer(recipe, subset), subset, pre_clipped)
    for k in subset:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(expected[k]), rtol=1e-5, atol=1e-7, err_msg=k)


def test_a_leaf_that_disagrees_with_the_table_is_refused(recipe, params):
    with pytest.raises(ValueError, match=r"lm_head\.weight has shape"):
        build_optimizer(recipe, {**params, "lm_head.weight": jnp.zeros((3, 3))})
    with pytest.raises(ValueError, match="not in the parameter table"):
        build_optimizer(recipe, {**params, "blocks.attention.w_extra": jnp.zeros((3, 3))})


# One leaf of each kind: expert stack (EP + FSDP over data), shared stack and layer-stacked matrix (FSDP over
# data x expert), the AdamH lm_head, Adam leaves. Leaves update independently, so a subset suffices.
SHARDED = (
    "blocks.moe.experts.w_gate",
    "blocks.moe.shared.w_down",
    "blocks.attention.w_q",
    "lm_head.weight",
    "embed.weight",
    "blocks.moe.router",
)


def test_state_shards_like_the_params_and_a_sharded_step_equals_the_single_device_one(
    recipe, params, grads, three_steps
):
    _, trained, _ = three_steps
    mesh = jax.make_mesh((1, 4, 2), ("replica", "data", "expert"), axis_types=(AxisType.Auto,) * 3)  # as routing
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    table = param_table(recipe)
    shardings = {k: NamedSharding(mesh, PartitionSpec(*partition_spec(table[k], sizes))) for k in SHARDED}
    assert shardings["blocks.moe.experts.w_gate"].spec[:2] == (None, "expert")
    assert ("data", "expert") in shardings["blocks.attention.w_q"].spec
    subset = {k: params[k] for k in SHARDED}
    optimizer = build_optimizer(recipe, subset)
    state_shardings = optimizer_state_shardings(optimizer, subset, shardings)

    flat = {path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(state_shardings)[0]}
    momentum = [k for k in flat if k.endswith(".momentum.blocks.moe.experts.w_gate")]
    assert len(momentum) == 1 and flat[momentum[0]] == shardings["blocks.moe.experts.w_gate"]
    second_moment = [k for k in flat if k.endswith(".nu.embed.weight")]
    assert len(second_moment) == 1 and flat[second_moment[0]] == shardings["embed.weight"]
    norms = [k for k in flat if k.endswith(".initial_norm.blocks.attention.w_q")]
    assert len(norms) == 1 and flat[norms[0]].spec == PartitionSpec()

    sharded = jax.device_put(subset, shardings)
    state = jax.jit(optimizer.init, out_shardings=state_shardings)(sharded)

    @functools.partial(jax.jit, out_shardings=(shardings, state_shardings))  # as the trainer's step
    def step(p, s, g):
        updates, s = optimizer.update(g, s, p)
        return optax.apply_updates(p, updates), s

    with jax.set_mesh(mesh):  # as the trainer runs its step: Newton-Schulz spreads its matrices over the mesh
        sharded_grads = [jax.device_put({k: g[k] for k in SHARDED}, shardings) for g in grads]
        hlo = step.lower(sharded, state, sharded_grads[0]).compile().as_text()
        for g in sharded_grads:
            sharded, state = step(sharded, state, g)
    # Every product is Newton-Schulz's, on whole matrices, ceil(n / 8) of each leaf's n per device, and the
    # reshards are all-to-alls: nothing gathers a whole leaf.
    per_device = {-(-math.prod(table[k].shape[:-2]) // 8) for k in SHARDED if table[k].group == "muonh"}
    dots = re.findall(r"= f32\[([0-9,]+)\]\S* dot\(", hlo)
    shapes = [tuple(int(n) for n in d.split(",")) for d in dots]
    assert shapes and {math.prod(d[:-2]) for d in shapes} <= per_device  # a lone matrix compiles to rank 2
    assert "all-gather" not in hlo
    for leaf, expected in zip(jax.tree.leaves(state), jax.tree.leaves(state_shardings), strict=True):
        assert leaf.sharding.is_equivalent_to(expected, leaf.ndim)
    for k in SHARDED:
        assert sharded[k].sharding.is_equivalent_to(shardings[k], sharded[k].ndim)
        np.testing.assert_allclose(np.asarray(sharded[k]), np.asarray(trained[k]), atol=2e-6, err_msg=k)


def test_state_is_arrays_with_unique_paths_and_round_trips_through_orbax(params, three_steps, tmp_path):
    optimizer, _, state = three_steps
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    assert all(isinstance(leaf, jax.Array) for _, leaf in leaves)
    keys = [path_str(p) for p, _ in leaves]
    assert len(set(keys)) == len(keys)  # flat {dotted path: array} checkpoints need unique names
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "state", state)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "state", jax.eval_shape(optimizer.init, params))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hero_state_holds_exactly_the_fp32_slots_the_planner_counts(hero_recipe):
    table = param_table(hero_recipe)
    params = {k: jax.ShapeDtypeStruct(spec.shape, jnp.float32) for k, spec in table.items()}
    state = jax.eval_shape(build_optimizer(hero_recipe, params).init, params)  # shapes only: 535B is not allocated
    shapes = {spec.shape for spec in table.values()}
    slots = [leaf for leaf in jax.tree.leaves(state) if leaf.shape in shapes]
    assert all(leaf.dtype == jnp.float32 for leaf in slots)
    assert sum(leaf.size for leaf in slots) == sum(optimizer_state_elems(spec) * spec.size for spec in table.values())
    rest = [leaf for leaf in jax.tree.leaves(state) if leaf.shape not in shapes]  # step counts, hyperball norms
    assert all(leaf.size <= hero_recipe.model.num_layers * hero_recipe.moe.shared_experts for leaf in rest)
