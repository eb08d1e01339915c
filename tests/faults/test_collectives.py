"""XLA:CPU collective order on 8 simulated devices (issue 14): the tiny recipe on data 2 x expert 4 with the
fixed transport aborted in XLA's rendezvous when devices entered an all-gather inside the optimizer's
Newton-Schulz while loop (data axis, e.g. devices [1, 5]) and the gradient all-reduce over all 8 devices in
different orders. Measured with tests/faults/collective_soak.py (eval, then two train steps, 3 times per
process): concurrency-optimized (BFS) scheduler 4 of 6 processes aborted (exit 134); the DFS default that
`marinctl.runtime` now applies 6 of 6 finished. Each process here runs that pattern; one abort fails."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from marinctl.runtime import YNN_DOTS_OFF

REPO = Path(__file__).resolve().parents[2]
SOAK = Path(__file__).with_name("collective_soak.py")


def soak(fault_env, data_root, iterations: int) -> subprocess.CompletedProcess:
    env = dict(fault_env)
    # Only the device count: the scheduler flag comes from marinctl.runtime, as in `marinctl train`. A short
    # terminate timeout turns the hang into a quick abort.
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 --xla_cpu_collective_call_terminate_timeout_seconds=40"
    args = [sys.executable, str(SOAK), str(REPO / "recipes" / "tiny.toml"), str(iterations),
            "moe.transport=fixed", "parallel.data=2", "parallel.expert=4", f"data.root={data_root}",
            "eval.batches=1", "schedule.changes=[]"]  # fmt: skip
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=900)


def test_cpu_default_disables_the_concurrency_optimized_scheduler(monkeypatch):
    from marinctl.recipe import RuntimeConfig
    from marinctl.runtime import apply_runtime

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    apply_runtime(RuntimeConfig())
    assert "--xla_cpu_enable_concurrency_optimized_scheduler=false" in os.environ["XLA_FLAGS"].split()
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_concurrency_optimized_scheduler=true")
    apply_runtime(RuntimeConfig())  # an explicit setting wins
    assert os.environ["XLA_FLAGS"].split() == ["--xla_cpu_enable_concurrency_optimized_scheduler=true", YNN_DOTS_OFF]


def test_cpu_default_sends_dots_to_xla_unless_the_environment_or_recipe_says_otherwise(monkeypatch):
    from marinctl.recipe import RuntimeConfig
    from marinctl.runtime import apply_runtime

    monkeypatch.setenv("XLA_FLAGS", "")
    apply_runtime(RuntimeConfig())
    assert YNN_DOTS_OFF in os.environ["XLA_FLAGS"].split()
    mine = "--xla_cpu_experimental_ynn_fusion_type=-dot"
    monkeypatch.setenv("XLA_FLAGS", "")
    apply_runtime(RuntimeConfig(xla_flags=(mine,)))  # the recipe's own value wins over the default
    assert os.environ["XLA_FLAGS"].split() == [mine, "--xla_cpu_enable_concurrency_optimized_scheduler=false"]


@pytest.mark.parametrize("run", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow),
                                 pytest.param(4, marks=pytest.mark.slow)])  # fmt: skip
def test_eval_then_train_steps_on_data2_expert4_never_abort(run, fault_env, fault_recipe):
    from marinctl.recipe import load_recipe

    result = soak(fault_env, load_recipe(fault_recipe).data.root, iterations=3)
    assert result.returncode == 0 and "ok 3" in result.stdout, (result.returncode, result.stderr[-3000:])
