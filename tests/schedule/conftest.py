"""Shared set-up for the schedule tests: the micro recipe (tests/micro.toml: 8 CPU devices, data 4 x expert 2,
fixed transport at capacity 1, so tokens drop) at 16 sequences of 32 tokens per step, so a context extension
to 64 still gives every device whole sequences. The schedule under test is the issue's, compressed:
fixed → ragged EP at step 5, 32 → 64 context (qk_mult auto) at step 10, a checkpoint every 5 steps, so one
lands exactly on the extension. One persistent XLA cache for the session: each program compiles once."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 16
RAGGED_AT, EXTEND_AT = 5, 10

BASE = """
extends = "{micro}"

[train]
steps = {steps}
batch_size = 16

[data]
root = "{data}"

[checkpoint]
every = 5
keep_last = 10

[eval]
every = 0
batches = 1
batch_size = 8

[log]
norms_every = 0
"""

SCHEDULE = """
[[schedule.changes]]
at_step = {ragged}
moe.transport = "ragged"

[[schedule.changes]]
at_step = {extend}
train.seq_len = 64
attention.qk_mult = "auto"
"""


@pytest.fixture(scope="session")
def schedule_env(tmp_path_factory):
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    cache = tmp_path_factory.mktemp("xla_cache")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    jax.config.update("jax_compilation_cache_dir", str(cache))
    compilation_cache.reset_cache()
    return cache


@pytest.fixture(scope="session")
def recipes(tmp_path_factory, schedule_env):
    """{"base": path without changes, "scheduled": path with the two changes}; the corpus built once."""
    from marinctl.data.builtin import ensure_builtin_corpus
    from marinctl.recipe import load_recipe

    root = tmp_path_factory.mktemp("schedule")
    base = BASE.format(micro=REPO / "tests" / "micro.toml", data=root / "data", steps=STEPS)
    paths = {"base": root / "base.toml", "scheduled": root / "scheduled.toml"}
    paths["base"].write_text(base)
    paths["scheduled"].write_text(base + SCHEDULE.format(ragged=RAGGED_AT, extend=EXTEND_AT))
    ensure_builtin_corpus(load_recipe(paths["base"]))
    return paths
