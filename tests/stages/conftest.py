"""One finished micro run shared by the eval/export tests: 2 steps, a checkpoint after each, an in-loop
dropless eval at steps 0, 1 and 2 (the oracle `marinctl eval` must reproduce), on 8 CPU devices with
expert parallelism (data 4 x expert 2) so the dropping transports have something to drop."""

import pytest


@pytest.fixture(scope="session")
def trained_run(micro_run_recipe):
    """(recipe, run_dir) of a finished 2-step run; metrics.jsonl holds its eval records. The trainer and both
    stages compile through the session's XLA cache (`configure_jax`), so the eval stage reuses the trainer's
    compiled eval step."""
    from marinctl.recipe import load_recipe
    from marinctl.train.loop import RunOptions, run

    path = micro_run_recipe(steps=2, checkpoint_every=1, eval_every=1, name="micro_run")
    recipe = load_recipe(path)
    run_dir = path.parent / "run"
    summary = run(recipe, RunOptions(run_dir=run_dir, quiet=True))
    assert summary.exit_reason == "done", summary.message
    return recipe, run_dir
