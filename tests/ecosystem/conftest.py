"""A small run directory with every architecture component on, made without training: random weights
(init scale raised so the layers matter) and a random QB router bias saved as a step-5 checkpoint by
`marinctl import`'s writer — the same files `marinctl train` leaves. Training is the trainer's business
(tests/train); these tests need weights that exercise every path of the forward pass."""

import os
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
TASKS = REPO / "tests" / "ecosystem" / "tasks"

RECIPE = """
extends = "{tiny}"
name = "eco"

[model]
hidden = 64
num_layers = 2
num_heads = 2
head_dim = 32
gated_norm_rank = 8
init_scale = 2.0
sconv_sites = ["keys", "values", "attn_out", "mlp_out"]

[attention]
local_kv_heads = 2
global_kv_heads = 1
window = 16

[moe]
num_experts = 8
top_k = 2
expert_width = 32
latent_width = 32
shared_experts = 2
shared_width = 32
transport = "pooled"
capacity_factor = 1.0

[schedule]
changes = []

[train]
seq_len = 128
batch_size = 8
steps = 10

[data]
root = "{data}"
"""


def make_params(recipe, seed: int = 0):
    """Random weights: the table's init, then every gain, conv tap and gate (init 1, identity or 0)
    perturbed so that no component is an identity the export could get wrong unnoticed."""
    import jax

    from marinctl.model.transformer import init_params
    from marinctl.params import param_table

    rng = np.random.default_rng(seed)
    params = {k: np.asarray(v) for k, v in init_params(recipe, jax.random.key(seed)).items()}
    for path, spec in param_table(recipe).items():
        if spec.init != "normal":
            params[path] = (params[path] + 0.3 * rng.standard_normal(spec.shape)).astype(np.float32)
    L, E = recipe.model.num_layers, recipe.moe.num_experts
    bias = (0.5 * rng.standard_normal((L, E))).astype(np.float32)
    return params, bias


@pytest.fixture(scope="session")
def eco_run(tmp_path_factory):
    """(recipe, run_dir, params, router_bias) of a step-5 checkpoint."""
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("xla_cache")))
    from marinctl.recipe import load_recipe
    from stages.import_run import write_run

    root = tmp_path_factory.mktemp("eco")
    path = root / "eco.toml"
    path.write_text(RECIPE.format(tiny=REPO / "recipes" / "tiny.toml", data=root / "data"))
    recipe = load_recipe(path)
    params, bias = make_params(recipe)
    run_dir = root / "run"
    run_dir.mkdir()
    write_run(run_dir, recipe, params, bias, step=5)
    return recipe, run_dir, params, bias


@pytest.fixture
def at_repo(monkeypatch, tmp_path):
    """Task YAMLs name their jsonl relative to the repository root; datasets caches under tmp."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
