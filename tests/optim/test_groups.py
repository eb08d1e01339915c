"""Parameter groups (marinctl/optim/groups.py): recipe §5's table, leaf by leaf, and the norm / matrix scopes."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marinctl.counting import count_params
from marinctl.optim.groups import (
    group_of,
    group_sizes,
    hyperball_norms,
    matrix_batch_ndim,
    norm_axes,
    param_group_labels,
)
from marinctl.params import param_table, tree_paths

# Every leaf of the tiny model and its group, written out from docs/recipe.md §5's table (not from the code).
TINY_GROUPS = {
    "embed.weight": "adam",  # token embedding
    "embed_norm.gain": "adam",  # 1-D gains
    "embed_gated_norm.w_down": "muonh",  # GatedNorm matrices
    "embed_gated_norm.w_up": "muonh",
    "blocks.attn_norm.gain": "adam",
    "blocks.attn_gated_norm.w_down": "muonh",
    "blocks.attn_gated_norm.w_up": "muonh",
    "blocks.attention.w_q": "muonh",
    "blocks.attention.w_k": "muonh",
    "blocks.attention.w_v": "muonh",
    "blocks.attention.w_o": "muonh",
    "blocks.attention.w_gate": "adam",  # attention gate
    "blocks.sconv_keys.weight": "adam",  # SConv kernels
    "blocks.sconv_attn_out.weight": "adam",
    "blocks.mlp_norm.gain": "adam",
    "blocks.mlp_gated_norm.w_down": "muonh",
    "blocks.mlp_gated_norm.w_up": "muonh",
    "blocks.moe.router": "adam",  # router weight
    "blocks.moe.latent_down": "muonh",  # latent projections
    "blocks.moe.latent_norm.gain": "adam",  # latent norm gain
    "blocks.moe.experts.w_gate": "muonh",  # routed experts
    "blocks.moe.experts.w_up": "muonh",
    "blocks.moe.experts.w_down": "muonh",
    "blocks.moe.latent_up": "muonh",
    "blocks.moe.shared.w_gate": "muonh",  # shared experts
    "blocks.moe.shared.w_up": "muonh",
    "blocks.moe.shared.w_down": "muonh",
    "blocks.sconv_mlp_out.weight": "adam",
    "final_norm.gain": "adam",
    "final_gated_norm.w_down": "muonh",
    "final_gated_norm.w_up": "muonh",
    "lm_head.weight": "adamh",  # lm_head
}


def test_every_leaf_of_the_tiny_model_gets_its_spec_5_group(tiny_recipe):
    from marinctl.model.transformer import init_model

    params = eqx.filter_eval_shape(init_model, tiny_recipe, jax.random.key(0))  # every leaf is a parameter
    labels = dict(zip(jax.tree.leaves(tree_paths(params)), jax.tree.leaves(param_group_labels(params)), strict=True))
    assert labels == TINY_GROUPS


@pytest.mark.parametrize("recipe_name", ["tiny_recipe", "hero_recipe"])
def test_path_rules_agree_with_the_parameter_table(recipe_name, request):
    table = param_table(request.getfixturevalue(recipe_name))
    assert {path: group_of(path) for path in table} == {path: spec.group for path, spec in table.items()}


def test_ablation_leaves_fall_in_the_adam_group():
    assert group_of("blocks.attention.qk_mult") == "adam"  # learnable per-head multiplier: a gain
    assert group_of("blocks.sconv_values.weight") == "adam"
    assert group_of("blocks.moe.router_bias") == "adam"


def test_group_sizes_partition_every_parameter_of_the_hero(hero_recipe):
    sizes = group_sizes(hero_recipe)
    assert sum(sizes.values()) == count_params(hero_recipe).total  # 535.48B, every leaf
    assert sizes["adamh"] == hero_recipe.model.hidden * hero_recipe.model.vocab_size  # the lm_head alone


def test_norm_scopes_are_per_layer_per_shared_expert_and_joint_over_experts(tiny_recipe):
    table = param_table(tiny_recipe)
    assert norm_axes(table["blocks.attention.w_q"]) == (1, 2)  # [L, D, H*Dh]: one norm per layer
    assert norm_axes(table["blocks.moe.experts.w_gate"]) == (1, 2, 3)  # [L, E, l, I]: per layer, over E
    assert norm_axes(table["blocks.moe.shared.w_down"]) == (2, 3)  # [L, n, Ish, D]: per layer and expert
    assert norm_axes(table["lm_head.weight"]) == (0, 1)  # one matrix
    assert norm_axes(table["final_gated_norm.w_up"]) == (0, 1)


def test_newton_schulz_batches_over_layers_experts_and_shared_experts(tiny_recipe):
    table = param_table(tiny_recipe)
    assert matrix_batch_ndim(table["blocks.attention.w_o"]) == 1
    assert matrix_batch_ndim(table["blocks.moe.experts.w_down"]) == 2
    assert matrix_batch_ndim(table["blocks.moe.shared.w_up"]) == 2
    assert matrix_batch_ndim(table["embed_gated_norm.w_down"]) == 0


def test_hyperball_norms_match_numpy_per_scope(micro_recipe):
    rng = np.random.default_rng(0)
    table = param_table(micro_recipe)
    params = {path: jnp.asarray(rng.standard_normal(spec.shape), jnp.float32) for path, spec in table.items()}
    norms = hyperball_norms(params, micro_recipe)
    assert set(norms) == {path for path, spec in table.items() if spec.group != "adam"}
    experts = np.asarray(params["blocks.moe.experts.w_up"], np.float64)
    np.testing.assert_allclose(norms["blocks.moe.experts.w_up"], np.sqrt((experts**2).sum(axis=(1, 2, 3))), rtol=1e-6)
    shared = np.asarray(params["blocks.moe.shared.w_gate"], np.float64)
    np.testing.assert_allclose(norms["blocks.moe.shared.w_gate"], np.sqrt((shared**2).sum(axis=(2, 3))), rtol=1e-6)
    head = np.asarray(params["lm_head.weight"], np.float64)
    np.testing.assert_allclose(norms["lm_head.weight"], np.sqrt((head**2).sum()), rtol=1e-6)
