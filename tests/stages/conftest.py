"""One finished micro run shared by the eval/export tests: 2 steps, a checkpoint after each, an in-loop
dropless eval at steps 0, 1 and 2 (the oracle `marinctl eval` must reproduce), on 8 CPU devices with
expert parallelism (data 4 x expert 2) so the dropping transports have something to drop."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

MICRO = """
extends = "{micro}"

[train]
steps = 2

[data]
root = "{data}"

[checkpoint]
every = 1
keep_last = 10

[eval]
every = 1
batches = 1
batch_size = 8
"""


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """(recipe, run_dir) of a finished 2-step run; metrics.jsonl holds its eval records."""
    # The trainer and both stages compile through this cache (`configure_jax`), so the eval stage reuses the
    # trainer's compiled eval step; never the user's ~/.cache from a test.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("xla_cache")))
    from marinctl.recipe import load_recipe
    from marinctl.train.loop import RunOptions, run

    root = tmp_path_factory.mktemp("micro_run")
    path = root / "micro.toml"
    path.write_text(MICRO.format(micro=REPO / "tests" / "micro.toml", data=root / "data"))
    recipe = load_recipe(path)
    run_dir = root / "run"
    summary = run(recipe, RunOptions(run_dir=run_dir, quiet=True))
    assert summary.exit_reason == "done", summary.message
    return recipe, run_dir
