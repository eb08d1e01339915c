"""Small model configs for the model tests: the tiny recipe's switches, shrunk so each compile is quick."""

import dataclasses

import pytest


def shrink(recipe, model=None, attention=None, moe=None, train=None):
    """The tiny recipe with smaller sections (every component stays on unless a test turns it off)."""
    m = dict(
        vocab_size=32,
        hidden=32,
        num_layers=2,
        num_heads=4,
        head_dim=8,
        gated_norm_rank=8,
        compute_dtype="float32",
        remat="none",
    )
    a = dict(local_kv_heads=2, global_kv_heads=1, window=4, global_every=2)
    e = dict(
        num_experts=8,
        top_k=2,
        expert_width=16,
        latent_width=16,
        shared_experts=1,
        shared_width=16,
        transport="dense",
        qb_bins=64,
    )
    t = dict(seq_len=16, batch_size=2)
    return recipe.replace(
        model=dataclasses.replace(recipe.model, **{**m, **(model or {})}),
        attention=dataclasses.replace(recipe.attention, **{**a, **(attention or {})}),
        moe=dataclasses.replace(recipe.moe, **{**e, **(moe or {})}),
        train=dataclasses.replace(recipe.train, **{**t, **(train or {})}),
    )


@pytest.fixture(scope="session")
def small_recipe(tiny_recipe):
    """D=32, L=2 (layer 0 local with window 4, layer 1 global), H=4, Dh=8, KV 2/1, 8 experts top-2."""
    return shrink(tiny_recipe)
