"""The ladder as a pipeline, for real: `ladder run` trains two micro rungs (each in its own `marinctl
train` process, evaluating at every 5% of its progress by `eval.ladder_grid`), skips them when run again,
fits and writes the forecast; the target then trains with `--forecast` and every eval record on the grid
carries `forecast` and `forecast_delta`, and `forecast.png` is drawn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marinctl.ladder import PROGRESS_GRID, grid_step, step_progress
from marinctl.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]

# tests/micro.toml at two widths (rungs) and a wider target, 0.4 tokens per active parameter; one device
# so the rungs' subprocesses and the target see the same mesh.
RUNG = """
extends = "{micro}"
name = "{name}"

[model]
hidden = {hidden}
num_heads = {heads}

[moe]
expert_width = {half}
latent_width = {half}

[train]
seq_len = 32
batch_size = 8
steps = 0
tokens_per_active_param = {ratio}

[parallel]
data = 1
expert = 1

[data]
root = "{data}"

[checkpoint]
every = 0

[eval]
every = 0
ladder_grid = true
batches = 1
batch_size = 8

[log]
norms_every = 0
"""


def write_recipe(root: Path, name: str, hidden: int, ratio: float) -> Path:
    path = root / f"{name}.toml"
    path.write_text(RUNG.format(micro=REPO / "tests" / "micro.toml", name=name, hidden=hidden, heads=hidden // 32,
                                half=hidden // 2, data=root / "data", ratio=ratio))  # fmt: skip
    return path


def one_device_env(base: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The subprocesses' environment: one CPU device (not the test session's 8), a private XLA cache."""
    env = {**base, "JAX_PLATFORMS": "cpu", "NO_COLOR": "1", "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla")}
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f)
    if flags:
        env["XLA_FLAGS"] = flags
    else:
        env.pop("XLA_FLAGS", None)
    return env


@pytest.mark.slow
def test_ladder_run_trains_skips_fits_and_the_target_is_tracked_against_the_forecast(tmp_path):
    env = one_device_env(os.environ, tmp_path)
    rungs = [write_recipe(tmp_path, "r32", 32, 0.4), write_recipe(tmp_path, "r64", 64, 0.4)]
    target = write_recipe(tmp_path, "target", 96, 0.4)
    target_steps = load_recipe(target).train.steps
    assert [load_recipe(p).train.steps for p in rungs] == [22, 72] and target_steps == 151

    def marinctl(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "marinctl.cli", *args], env=env, capture_output=True, text=True,
                              timeout=900, cwd=tmp_path)  # fmt: skip

    root = tmp_path / "ladder"
    args = ["ladder", "run", *map(str, rungs), "--root", str(root), "--target", str(target), "--irreducible", "1"]
    done = marinctl(*args, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert [r["status"] for r in out["rungs"]] == ["trained", "trained"]
    for rung in out["rungs"]:  # evaluated at every grid step without setting eval.every
        steps = rung["steps"]
        evals = [json.loads(x) for x in (root / rung["name"] / "metrics.jsonl").read_text().splitlines()]
        eval_steps = sorted({r["step"] for r in evals if r["kind"] == "eval"})
        assert eval_steps == sorted({0, *(grid_step(g, steps) for g in PROGRESS_GRID)})
    assert out["fit"]["forecast"] is not None and (root / "forecast.json").is_file()

    again = marinctl(*args, "--json")  # finished rungs are skipped; the fit is the same
    assert again.returncode == 0, again.stderr[-3000:]
    out2 = json.loads(again.stdout)
    assert [r["status"] for r in out2["rungs"]] == ["done", "done"] and out2["fit"] == out["fit"]

    run_dir = tmp_path / "target-run"
    done = marinctl("train", str(target), "--run-dir", str(run_dir), "--forecast", str(root / "forecast.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "forecast" in done.stderr and "actual − forecast" in done.stderr
    forecast = {p["progress"]: p["forecast"] for p in json.loads((root / "forecast.json").read_text())["curve"]}
    evals = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r["kind"] == "eval"]
    assert "forecast" not in evals[0]  # step 0: the fit starts at 5%
    for record in evals[1:]:
        g = step_progress(record["step"], target_steps)
        assert g in forecast and record["forecast"] == pytest.approx(forecast[g], rel=1e-12)
        assert record["forecast_delta"] == pytest.approx(record["macro_loss"] - forecast[g], rel=1e-12)
    assert (run_dir / "forecast.png").read_bytes()[:4] == b"\x89PNG"


def test_ladder_run_sbatch_trains_the_rungs_as_requeueable_jobs_on_a_real_slurm(slurm, tmp_path):
    """`--sbatch` against slurmctld + slurmd on localhost: one job per rung, each a real `marinctl train`;
    once they finish, the same command skips them all and fits."""
    import time

    env = one_device_env(slurm, tmp_path)
    rungs = [write_recipe(tmp_path, "r32", 32, 0.4), write_recipe(tmp_path, "r64", 64, 0.4)]
    target = write_recipe(tmp_path, "target", 96, 0.4)
    root = tmp_path / "ladder"
    args = [sys.executable, "-m", "marinctl.cli", "ladder", "run", *map(str, rungs), "--root", str(root),
            "--target", str(target), "--sbatch", "--irreducible", "1", "--json"]  # fmt: skip
    done = subprocess.run(args, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [r["status"] for r in out["rungs"]] == ["submitted", "submitted"] and out["fit"] is None
    jobs = [r["job_id"] for r in out["rungs"]]
    assert "#SBATCH --requeue" in (root / "r32.sbatch").read_text()

    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        queue = subprocess.run(["squeue", "-h", "-j", ",".join(jobs), "-o", "%i %T"], env=env, capture_output=True,
                               text=True)  # fmt: skip
        if not queue.stdout.strip():
            break
        time.sleep(2)
    else:
        pytest.fail(f"SLURM jobs {jobs} still queued after 900 s: {queue.stdout}")
    for rung, job in zip(("r32", "r64"), jobs, strict=True):
        log = (root / f"{rung}.slurm-{job}.out").read_text()
        assert (root / rung / "metrics.jsonl").is_file(), log[-3000:]

    done = subprocess.run(args, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert [r["status"] for r in out["rungs"]] == ["done", "done"]
    assert out["fit"]["forecast"] is not None and (root / "forecast.json").is_file()


@pytest.mark.slow
def test_a_requeued_rung_job_checkpoints_and_resumes_on_a_real_slurm(slurm, tmp_path):
    """`scontrol requeue` while a rung trains: SLURM signals the job, the trainer checkpoints and exits 3,
    the job goes back to the queue (`--requeue`) and its second start resumes from the checkpoint."""
    import time

    env = one_device_env(slurm, tmp_path)
    rungs = [write_recipe(tmp_path, "r32", 32, 0.4), write_recipe(tmp_path, "r64", 64, 0.4)]
    root = tmp_path / "ladder"
    args = [sys.executable, "-m", "marinctl.cli", "ladder", "run", *map(str, rungs), "--root", str(root), "--sbatch",
            "--json"]  # fmt: skip
    done = subprocess.run(args, env=env, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    job = json.loads(done.stdout)["rungs"][1]["job_id"]
    metrics = root / "r64" / "metrics.jsonl"

    def trained_steps() -> int:
        if not metrics.is_file():
            return 0
        records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        return max((r["step"] for r in records if r.get("kind") == "train"), default=0)

    deadline = time.monotonic() + 600
    while trained_steps() < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert 3 <= trained_steps() < 71, "the rung finished (or never started) before it could be requeued"
    subprocess.run(["scontrol", "requeue", job], env=env, check=True, capture_output=True)

    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        queue = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True)
        if not queue.stdout.strip():
            break
        subprocess.run(["scontrol", "release", job], env=env, capture_output=True)  # a requeued job may be held
        time.sleep(2)
    else:
        pytest.fail(f"jobs still queued after 900 s: {queue.stdout}")
    log = (root / f"r64.slurm-{job}.out").read_text()
    assert "preempted: checkpoint at step" in log, log[-3000:]
    assert "resumed from step" in log, log[-3000:]
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    assert any(r.get("kind") == "eval" and r["step"] == 72 and r.get("macro_loss") for r in records)
