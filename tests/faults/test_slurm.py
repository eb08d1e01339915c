"""A real single-node SLURM cluster on localhost (munged, slurmctld, slurmd with their own config, state and spool
under a temp dir; stopped by pid at the end) running the README's SLURM script on the micro recipe:
`scontrol requeue` mid-run -> exit 3 -> SLURM restarts it -> it resumes and finishes with the uninterrupted
run's losses; the time-limit path (`--time=1 --signal=USR1@50`) -> checkpoint, exit 3, requeued; and
`srun --ntasks=2` forming a 2-process JAX run from SLURM's environment alone, equal to 1 x 8.
Skipped with the reason when slurm-wlm/munge are not installed or not run as root (.ci/run installs them)."""

import re
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cluster(slurm_cluster, fault_env):
    """The session's cluster, its jobs run in the fault suite's environment; their jobs cancelled at the end."""
    c = slurm_cluster.with_env({**fault_env, "PATH": slurm_cluster.env["PATH"]})
    yield c
    for job in c.run("squeue", "-h", "-o", "%i", check=False).split():
        c.run("scancel", job, check=False)


def readme_script(recipe: Path, run_dir: Path, extra: str = "", args: str = "") -> str:
    """The README's SLURM script, with the hero recipe and resources swapped for the micro run."""
    text = (REPO / "README.md").read_text()
    script = re.search(r"```bash\n(#!/bin/bash\n#SBATCH[^`]*?)```", text).group(1)
    assert "--signal=USR1@" in script and "B:USR1" not in script  # signals reach the srun tasks
    script = re.sub(r"#SBATCH .*", f"#SBATCH --ntasks=1 --requeue {extra}".rstrip(), script)
    return script.replace("recipes/hero.toml", f"{recipe} --json {args}").replace("/shared/runs/hero", str(run_dir))


def test_scontrol_requeue_mid_run_resumes_and_matches_the_uninterrupted_run(h, cluster, fault_recipe, reference,
                                                                            tmp_path):  # fmt: skip
    t0 = time.monotonic()
    run_dir = tmp_path / "run"
    job = cluster.sbatch(readme_script(fault_recipe, run_dir))
    h.wait_until(lambda: h.committed_steps(run_dir / "checkpoints"), None, 600, "the first checkpoint", poll=0.2)
    cluster.run("scontrol", "requeue", job)
    info = cluster.wait_job(job, lambda j: j.get("JobState") == "COMPLETED", 900, "completed")
    assert int(info["Restarts"]) == 1, info
    out = (cluster.root / f"{job}.out").read_text()
    assert '"exit_reason": "done"' in out, out[-3000:]
    # Whether the requeue's SIGTERM produced an extra checkpoint depends on the step it lands on (a multiple of
    # `checkpoint.every` coincides with a regular one), so it is not asserted here: SIGTERM -> checkpoint -> exit 3
    # is proven by tests/train/test_loop.py and, under SLURM, by the time-limit test below.
    assert h.train_losses(run_dir) == reference["losses"]
    h.assert_bitwise_equal(h.final_state(run_dir / "checkpoints", h.STEPS), reference["state"])
    print(f"SLURM requeue test wall time {time.monotonic() - t0:.0f}s")


def test_time_limit_signal_reaches_the_trainer_which_checkpoints_exits_3_and_is_requeued(h, cluster, fault_recipe,
                                                                                         tmp_path):  # fmt: skip
    t0 = time.monotonic()
    run_dir = tmp_path / "run"
    # One minute of wall time, USR1 when 50 s are left (SLURM checks about every 30 s), a run longer than that.
    job = cluster.sbatch(readme_script(fault_recipe, run_dir, "--time=1 --signal=USR1@50", "--set train.steps=400"))
    info = cluster.wait_job(job, lambda j: int(j.get("Restarts", 0)) >= 1, 400, "requeued")
    steps = h.committed_steps(run_dir / "checkpoints")
    out = (cluster.root / f"{job}.out").read_text()
    # Requeued at all means the script saw exit 3: only the trainer's preemption path exits 3.
    assert steps and all(s < 400 for s in steps), (steps, out[-3000:])
    cluster.run("scancel", job)
    print(f"SLURM time-limit test wall time {time.monotonic() - t0:.0f}s; requeued with checkpoints {steps}; {info}")


def test_srun_two_tasks_form_a_distributed_run_from_slurm_variables(h, cluster, fault_recipe, reference, tmp_path):
    t0 = time.monotonic()
    run_dir = tmp_path / "run"
    script = f"""#!/bin/bash
export XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_cpu_enable_concurrency_optimized_scheduler=false"
srun --ntasks=2 {REPO}/.venv/bin/marinctl train {fault_recipe} --run-dir {run_dir} --json -q
"""
    job = cluster.sbatch(script, "--ntasks=2")
    h.wait_until(lambda: (run_dir / "metrics.jsonl").exists() and len(h.train_losses(run_dir)) >= 3, None, 900,
                 "three steps of the 2-process run", poll=0.2)  # fmt: skip
    cluster.run("scancel", "--signal=TERM", job)  # the srun tasks (not the batch shell): checkpoint, exit 3
    cluster.wait_job(job, lambda j: j.get("JobState") not in ("RUNNING", "PENDING", "COMPLETING"), 300, "ended")
    out = (cluster.root / f"{job}.out").read_text()
    assert out.count('"exit_reason": "preempted"') == 2, out[-3000:]  # both processes, one summary each
    losses = h.train_losses(run_dir)  # written by process 0
    np.testing.assert_allclose(losses, reference["losses"][: len(losses)], rtol=1e-5)
    print(f"SLURM srun 2x4 test wall time {time.monotonic() - t0:.0f}s, {len(losses)} steps")
