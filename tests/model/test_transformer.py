"""The assembled model: its tree equals the parameter table, init follows the spec, per-layer facts follow the
layer pattern, outputs respect causality and document boundaries, and the tiny recipe trains on CPU."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marinctl.counting import count_params
from marinctl.model import transformer
from marinctl.model.attention import UNBOUNDED_WINDOW
from marinctl.model.loss import model_loss
from marinctl.model.transformer import build_model, document_positions, init_model, layer_runs, model_params
from marinctl.params import param_table

# The init code is key-type agnostic; RBG keys compile ~3× faster on CPU than threefry (test budget).
KEY = jax.random.key(0, impl="rbg")


def abstract_params(recipe):
    return model_params(eqx.filter_eval_shape(init_model, recipe, KEY))


def replace(recipe, section, **fields):
    return recipe.replace(**{section: dataclasses.replace(getattr(recipe, section), **fields)})


VARIANTS = {
    "tiny": lambda r: r,
    "no_gated_norm": lambda r: replace(r, "model", gated_norm=False),
    "no_embed_norm": lambda r: replace(r, "model", embed_norm=False),
    "sconv_values_only": lambda r: replace(r, "model", sconv_sites=("values",), sconv_kernel=2),
    "no_gate_learnable_qk": lambda r: replace(r, "attention", gate=False, qk_mult_learnable=True),
    "no_latent_no_shared": lambda r: replace(r, "moe", latent=False, shared_experts=0),
    "no_latent_norm": lambda r: replace(r, "moe", latent_norm=False),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_model_tree_equals_the_parameter_table_leaf_for_leaf(tiny_recipe, variant):
    recipe = VARIANTS[variant](tiny_recipe)
    params = abstract_params(recipe)
    table = param_table(recipe)
    assert list(params) == list(table)  # same paths, same order (docs/recipe.md §2 order)
    for path, spec in table.items():
        assert params[path].shape == spec.shape, path
        assert params[path].dtype == jnp.float32, path


def test_hero_model_tree_equals_the_parameter_table(hero_recipe):
    params = abstract_params(hero_recipe)
    assert {p: a.shape for p, a in params.items()} == {p: s.shape for p, s in param_table(hero_recipe).items()}


@pytest.fixture(scope="module")
def tiny_model(tiny_recipe):
    return init_model(tiny_recipe, KEY)


def test_instantiated_tiny_model_has_the_planned_parameter_count(tiny_recipe, tiny_model):
    n = sum(int(np.prod(a.shape)) for a in jax.tree_util.tree_leaves(tiny_model))
    assert n == count_params(tiny_recipe).total


def test_init_follows_each_leaf_spec(tiny_recipe, tiny_model):
    std = tiny_recipe.model.init_scale / np.sqrt(tiny_recipe.model.hidden)
    for path, spec in param_table(tiny_recipe).items():
        w = np.asarray(model_params(tiny_model)[path])
        if spec.init == "normal":
            assert np.abs(w).max() <= 3 * std * (1 + 1e-6), path
            # truncated at ±3σ the standard deviation is 0.9866σ
            assert abs(w.std() / (0.9866 * std) - 1) < (0.05 if w.size > 20000 else 0.15), path
        elif spec.init == "ones":
            assert np.all(w == 1), path
        elif spec.init == "zeros":
            assert np.all(w == 0), path
        else:  # identity_conv: lag 0 is 1, other lags 0
            assert np.all(w[:, 0] == 1) and np.all(w[:, 1:] == 0), path


def test_init_draws_equal_draws_in_each_leaf_shape_on_any_mesh(tiny_recipe):
    """`draw_shape` merges a leaf's unsharded trailing dims for its draw (a faster compile): the trainer's
    threefry init must still equal a plain draw in the leaf's shape, off a mesh and sharded over 8 experts."""
    from jax.sharding import NamedSharding, PartitionSpec

    from marinctl.params import partition_spec
    from marinctl.recipe import ParallelConfig
    from marinctl.routing.mesh import make_mesh

    key = jax.random.key(7)  # threefry, as `train.state.model_key`
    table, sizes = param_table(tiny_recipe), {"replica": 1, "data": 1, "expert": 8}
    std = tiny_recipe.model.init_scale / np.sqrt(tiny_recipe.model.hidden)
    normal = {p: s for p, s in table.items() if s.init == "normal"}
    draws = {p: (transformer.draw_shape(s, {}), transformer.draw_shape(s, sizes)) for p, s in normal.items()}
    # Off a mesh every draw is 1-D; on it, the expert stacks keep their sharded dims.
    assert all(len(off) == 1 for off, _ in draws.values())
    assert any(len(normal[p].shape) > len(on) > 1 for p, (_, on) in draws.items())
    mesh = make_mesh(ParallelConfig(replica=1, data=1, expert=8))
    shardings = {p: NamedSharding(mesh, PartitionSpec(*partition_spec(s, sizes))) for p, s in table.items()}
    plain = jax.jit(lambda: transformer.init_params(tiny_recipe, key))()
    with jax.set_mesh(mesh):
        sharded = jax.jit(lambda: transformer.init_params(tiny_recipe, key), out_shardings=shardings)()
    for path, spec in normal.items():
        leaf_key = jax.random.fold_in(key, transformer.zlib.crc32(path.encode()) & 0x7FFFFFFF)
        expected = np.asarray(std * jax.random.truncated_normal(leaf_key, -3.0, 3.0, spec.shape, jnp.float32))
        np.testing.assert_array_equal(np.asarray(plain[path]), expected, err_msg=path)
        np.testing.assert_array_equal(np.asarray(sharded[path]), expected, err_msg=path)


def test_layer_facts_follow_the_local_global_pattern(tiny_recipe, tiny_model):
    facts = tiny_model.layer_facts()
    a = tiny_recipe.attention
    assert np.asarray(facts.is_global).tolist() == [False, False, False, True]
    assert np.asarray(facts.window).tolist() == [a.window] * 3 + [UNBOUNDED_WINDOW]
    assert np.asarray(facts.rope).tolist() == [True, True, True, False]  # NoPE on the global layer
    assert np.asarray(facts.kv_of_head).tolist() == [[0, 0, 1, 1]] * 3 + [[0, 0, 0, 0]]


def test_document_positions_restart_at_every_document():
    seg = np.array([[1, 1, 1, 2, 2, 0, 0], [5, 5, 5, 5, 5, 5, 6]])
    expected = [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 0]]
    assert np.asarray(document_positions(jnp.asarray(seg))).tolist() == expected


@pytest.fixture(scope="module")
def small(small_recipe):
    model = init_model(small_recipe, KEY)
    # Non-trivial SConv taps and attention gate, so the boundary tests exercise them.
    rng = np.random.default_rng(0)
    model = eqx.tree_at(
        lambda m: (
            m.blocks.sconv_keys.weight,
            m.blocks.sconv_attn_out.weight,
            m.blocks.sconv_mlp_out.weight,
            m.blocks.attention.w_gate,
        ),
        model,
        replace_fn=lambda w: jnp.asarray(rng.normal(size=w.shape).astype(np.float32) * 0.5),
    )
    return model, eqx.filter_jit(lambda m, t, s, b: m(t, s, b)[0])


def test_changing_later_tokens_never_changes_earlier_outputs(small_recipe, small):
    model, forward = small
    S, V, L, E = small_recipe.train.seq_len, small_recipe.model.vocab_size, 2, small_recipe.moe.num_experts
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, V, size=(2, S))
    seg = np.ones((2, S), np.int32)
    bias = jnp.asarray(rng.normal(size=(L, E)).astype(np.float32))
    t = 9
    changed = tokens.copy()
    changed[:, t + 1 :] = rng.integers(0, V, size=(2, S - t - 1))
    before = np.asarray(forward(model, jnp.asarray(tokens), jnp.asarray(seg), bias))
    after = np.asarray(forward(model, jnp.asarray(changed), jnp.asarray(seg), bias))
    np.testing.assert_array_equal(after[:, : t + 1], before[:, : t + 1])
    assert np.abs(after[:, t + 1 :] - before[:, t + 1 :]).max() > 1e-4  # the change does reach later tokens


def test_changing_a_document_never_changes_the_next_document_in_the_packed_sequence(small_recipe, small):
    model, forward = small
    S, V, E = small_recipe.train.seq_len, small_recipe.model.vocab_size, small_recipe.moe.num_experts
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, V, size=(2, S))
    seg = np.array([[1] * 7 + [2] * 6 + [0] * 3, [3] * 5 + [4] * 11])
    bias = jnp.zeros((2, E))
    changed = tokens.copy()
    changed[0, :7] = rng.integers(0, V, size=7)  # rewrite document 1
    changed[1, :5] = rng.integers(0, V, size=5)  # rewrite document 3
    before = np.asarray(forward(model, jnp.asarray(tokens), jnp.asarray(seg), bias))
    after = np.asarray(forward(model, jnp.asarray(changed), jnp.asarray(seg), bias))
    np.testing.assert_array_equal(after[0, 7:13], before[0, 7:13])
    np.testing.assert_array_equal(after[1, 5:], before[1, 5:])
    assert np.abs(after[0, :7] - before[0, :7]).max() > 1e-4


def batch_for(recipe, B, seed=0):
    S, V = recipe.train.seq_len, recipe.model.vocab_size
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(B, S + 1))
    seg = np.ones((B, S), np.int32)
    seg[0, S // 2 :] = 2
    seg[-1, -3:] = 0  # padding
    mask = (seg != 0).astype(np.float32)
    mask[0, S // 2 - 1] = 0  # the last token of document 1 does not predict document 2
    return {
        "tokens": jnp.asarray(tokens[:, :-1]),
        "targets": jnp.asarray(tokens[:, 1:]),
        "segment_ids": jnp.asarray(seg),
        "loss_mask": jnp.asarray(mask),
    }


def loss_and_grad(recipe):
    loss = lambda model, batch, bias: model_loss(model, batch, bias, recipe)  # noqa: E731  (recipe: static)
    return eqx.filter_jit(eqx.filter_value_and_grad(loss, has_aux=True))


def test_tiny_recipe_forward_and_backward_compile_and_run_with_finite_values(tiny_recipe, tiny_model):
    recipe = replace(tiny_recipe, "moe", transport="dense")
    L, E = recipe.model.num_layers, recipe.moe.num_experts
    batch = batch_for(recipe, 2)
    (loss, aux), grads = loss_and_grad(recipe)(tiny_model, batch, jnp.zeros((L, E)))
    assert np.isfinite(float(loss))
    assert abs(float(aux["ce"]) - np.log(recipe.model.vocab_size)) < 0.5  # near uniform at init
    assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree_util.tree_leaves(grads))
    assert np.asarray(grads.blocks.attention.w_gate).any()  # gradients reach the zero-init gate
    assert aux["beta"].shape == aux["expert_load"].shape == (L, E)
    for name in ("assignments", "sender_drops", "receiver_drops", "router_z"):
        assert aux[name].shape == (L,)
    n_valid = int(np.sum(np.asarray(batch["segment_ids"]) != 0))
    np.testing.assert_array_equal(np.asarray(aux["assignments"]), recipe.moe.top_k * n_valid)


@pytest.fixture(scope="module")
def no_remat_gradients(small_recipe, small):
    model, _ = small
    batch = batch_for(small_recipe, 2, seed=3)
    bias = jnp.zeros((2, small_recipe.moe.num_experts))
    (loss, _), grads = loss_and_grad(small_recipe)(dataclasses.replace(model, remat="none"), batch, bias)
    return batch, bias, float(loss), jax.tree_util.tree_leaves(grads)


@pytest.mark.parametrize("remat", ["full", pytest.param("save_dots", marks=pytest.mark.slow)])
def test_remat_policy_gives_the_same_loss_and_gradients_as_no_remat(small_recipe, small, no_remat_gradients, remat):
    model, _ = small
    batch, bias, ref_loss, ref_grads = no_remat_gradients
    (loss, _), grads = loss_and_grad(small_recipe)(dataclasses.replace(model, remat=remat), batch, bias)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-6)
    for g, g_ref in zip(jax.tree_util.tree_leaves(grads), ref_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    ("layers", "runs", "unroll_max"),
    [
        (4, [(0, 3, False), (3, 4, True)], 8),  # unrolled: straight-line layers
        (4, [(0, 3, False), (3, 4, True)], 0),  # one period of scans
        (8, [(0, 3, False), (3, 4, True)], 0),  # two periods: an outer scan over the scans
    ],
)
def test_scans_of_same_kind_layers_equal_one_scan_with_a_cond_between_kinds(
    small_recipe, layers, runs, unroll_max, monkeypatch
):
    """remat "none" scans each run of local (global) layers with the kind static (or, at most
    UNROLL_MAX_LAYERS layers, unrolls them); "full" keeps one scan over every layer with a `lax.cond` on the
    kind (transformer.layer_runs). Same loss, stats and gradients."""
    monkeypatch.setattr(transformer, "UNROLL_MAX_LAYERS", unroll_max)
    recipe = replace(replace(small_recipe, "model", num_layers=layers), "attention", global_every=4)
    assert layer_runs(recipe.layer_is_global()) == (4, runs)
    model = init_model(recipe, KEY)
    batch = batch_for(recipe, 2, seed=5)
    bias = jnp.asarray(np.random.default_rng(1).normal(size=(layers, recipe.moe.num_experts)) * 0.1)
    out = {}
    for remat in ("none", "full"):
        (loss, aux), grads = loss_and_grad(recipe)(dataclasses.replace(model, remat=remat), batch, bias)
        out[remat] = (float(loss), aux, jax.tree_util.tree_leaves(grads))
    assert out["none"][0] == pytest.approx(out["full"][0], rel=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(out["none"][1]), jax.tree_util.tree_leaves(out["full"][1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    for g, g_ref in zip(out["none"][2], out["full"][2], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-7)


def test_bfloat16_compute_tracks_float32_with_fp32_logits(small_recipe, small):
    model, forward = small
    batch = batch_for(small_recipe, 2, seed=4)
    bias = jnp.zeros((2, small_recipe.moe.num_experts))
    out = {}
    for dtype in ("float32", "bfloat16"):
        logits = forward(dataclasses.replace(model, compute_dtype=dtype), batch["tokens"], batch["segment_ids"], bias)
        assert logits.dtype == jnp.float32
        out[dtype] = np.asarray(logits)
    assert np.abs(out["bfloat16"] - out["float32"]).max() < 0.05 * np.abs(out["float32"]).max()


@pytest.mark.slow
def test_the_model_on_an_8_device_expert_parallel_mesh_matches_one_device(small_recipe, small):
    from marinctl.routing.mesh import batch_sharding, make_mesh, param_shardings

    model, _ = small
    recipe = small_recipe.replace(
        moe=dataclasses.replace(small_recipe.moe, transport="ragged"),  # dropless, so equal to dense
        parallel=dataclasses.replace(small_recipe.parallel, data=2, expert=4),
        train=dataclasses.replace(small_recipe.train, batch_size=8),
    )
    batch = batch_for(recipe, 8, seed=5)
    bias = jnp.zeros((2, recipe.moe.num_experts))
    (ref_loss, _), ref_grads = loss_and_grad(small_recipe)(model, batch, bias)
    mesh = make_mesh(recipe.parallel)
    with jax.set_mesh(mesh):
        sharded = build_model(recipe, model_params(jax.device_put(model, param_shardings(model, recipe, mesh))))
        (loss, _), grads = loss_and_grad(recipe)(sharded, jax.device_put(batch, batch_sharding(mesh)), bias)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-5)
    for g, g_ref in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(ref_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-3, atol=1e-6)
