"""A micro version of the tiny recipe: every component on, small enough for many optimizer steps on 2 cores."""

from pathlib import Path

import pytest

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny.toml"

MICRO = [
    "model.hidden=64",
    "model.num_heads=2",
    "model.head_dim=32",
    "model.num_layers=2",  # layer 0 local, layer 1 global (the last layer always is)
    "model.gated_norm_rank=8",
    "model.vocab_size=64",
    "attention.local_kv_heads=2",
    "attention.global_kv_heads=1",
    "attention.window=16",
    "moe.num_experts=8",
    "moe.top_k=2",
    "moe.expert_width=32",
    "moe.latent_width=32",
    "moe.shared_experts=2",
    "moe.shared_width=32",
    "moe.transport=dense",
    "train.seq_len=32",
    "train.batch_size=8",
    "train.steps=200",
    "schedule.changes=[]",  # tiny.toml's mid-run changes (a 1024 context) do not fit 256 tokens per step
]


@pytest.fixture(scope="session")
def micro_recipe():
    from marinctl.recipe import load_recipe

    return load_recipe(TINY, MICRO)
