"""Shared set-up for the schedule tests: the micro recipe (tests/micro.toml: 8 CPU devices, data 4 x expert 2,
fixed transport at capacity 1, so tokens drop) at 16 sequences of 32 tokens per step, so a context extension
to 64 still gives every device whole sequences. The schedule under test is the issue's, compressed:
fixed → ragged EP at step 5, 32 → 64 context (qk_mult auto) at step 10, a checkpoint every 5 steps, so one
lands exactly on the extension. One persistent XLA cache for the session: each program compiles once."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STEPS = 16
RAGGED_AT, EXTEND_AT = 5, 10

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
def recipes(micro_run_recipe):
    """{"base": path without changes, "scheduled": path with the two changes}; 16 sequences per step."""
    common = {"steps": STEPS, "checkpoint_every": 5, "eval_every": 0, "norms_every": 0, "batch_size": 16,
              "eval_batch_size": 16}  # 16 x 32 eval tokens: 8 rows at 64, one per device  # fmt: skip
    return {
        "base": micro_run_recipe(**common, name="base"),
        "scheduled": micro_run_recipe(
            **common, extra=SCHEDULE.format(ragged=RAGGED_AT, extend=EXTEND_AT), name="scheduled"
        ),
    }
