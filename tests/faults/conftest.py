"""Shared set-up for the fault-injection suite: a micro run (8 CPU devices, data 4 x expert 2, fixed capacity,
checkpoint every 4 of 12 steps), one persistent XLA cache, trainer subprocesses, and a reference run.

Every fault is real: signals to real processes, real file systems filling up, real bytes damaged. Each test
compares the faulted run with the uninterrupted reference where the outcome should be identical."""

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]

STEPS = 12


@pytest.fixture(scope="session")
def fault_env(subprocess_env):
    """Environment for trainer subprocesses: 8 CPU devices, the session's compilation cache."""
    return subprocess_env


@pytest.fixture(scope="session")
def fault_recipe(micro_run_recipe) -> Path:
    """tests/micro.toml, 12 steps, a checkpoint and an in-loop eval every 4."""
    return micro_run_recipe(steps=STEPS, checkpoint_every=4, eval_every=4, norms_every=0, name="faults_micro")


class Trainer:
    """`marinctl train` as a subprocess, and the observations the fault tests make of a run dir."""

    def __init__(self, env: dict, recipe: Path, process):
        self.env, self.recipe, (self._launch, self._finish) = env, recipe, process

    def args(self, run_dir: Path, *extra: str) -> list[str]:
        return ["train", str(self.recipe), "--run-dir", str(run_dir), "--json", "--quiet", *extra]

    def launch(self, run_dir: Path, *extra: str, env: dict | None = None, quiet: bool = True) -> subprocess.Popen:
        args = self.args(run_dir, *extra)
        if not quiet:
            args.remove("--quiet")
        return self._launch(args, {**self.env, **(env or {})})

    def finish(self, proc: subprocess.Popen, timeout: float = 400) -> tuple[int, dict | None, str]:
        """(exit code, the --json summary or None, stdout+stderr)."""
        rc, summary, out, err = self._finish(proc, timeout)
        return rc, summary, out + err

    def run(self, run_dir: Path, *extra: str, timeout: float = 400, **kw) -> tuple[int, dict | None, str]:
        return self.finish(self.launch(run_dir, *extra, **kw), timeout)

    @staticmethod
    def kill(proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        assert proc.returncode == -signal.SIGKILL


def committed_steps(ckpt_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt_dir.iterdir() if p.name.isdigit()) if ckpt_dir.is_dir() else []


def train_losses(run_dir: Path) -> list[float]:
    from marinctl.train.metrics import read_metrics

    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def final_state(ckpt_dir: Path, step: int) -> dict[str, np.ndarray]:
    """The checkpoint's arrays, restored onto this process's first device whatever topology saved them (a
    2-process run's checkpoint names devices this process does not have)."""
    import jax
    import orbax.checkpoint as ocp

    path = (ckpt_dir / str(step) / "state").absolute()
    checkpointer = ocp.StandardCheckpointer()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), checkpointer.metadata(path).item_metadata
    )
    return {k: np.asarray(v) for k, v in checkpointer.restore(path, target).items()}


def assert_bitwise_equal(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    for key in theirs:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def wait_until(predicate, proc: subprocess.Popen | None, timeout: float, what: str, poll: float = 0.005):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"run ended (rc {proc.returncode}) before {what}:\n{(out + err)[-3000:]}")
        time.sleep(poll)
    if proc is not None:
        proc.send_signal(signal.SIGKILL)
    raise AssertionError(f"not within {timeout}s: {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def trainer(fault_env, fault_recipe, marinctl_process) -> Trainer:
    return Trainer(fault_env, fault_recipe, marinctl_process)


@pytest.fixture(scope="session")
def reference(trainer, tmp_path_factory):
    """The uninterrupted run (a subprocess, like every faulted one): losses and final state."""
    run_dir = tmp_path_factory.mktemp("reference")
    rc, summary, out = trainer.run(run_dir)
    assert rc == 0, out[-3000:]
    return {
        "run_dir": run_dir,
        "summary": summary,
        "losses": train_losses(run_dir),
        "state": final_state(run_dir / "checkpoints", STEPS),
    }


def copy_data(recipe: Path, dest: Path) -> Path:
    """A private copy of the run's token stores (for tests that rewrite them)."""
    from marinctl.recipe import load_recipe

    shutil.copytree(load_recipe(recipe).data.root, dest)
    return dest


@pytest.fixture(scope="session")
def h():
    """The helpers above, for test modules (importlib import mode: test modules cannot import conftest)."""
    from types import SimpleNamespace

    return SimpleNamespace(
        STEPS=STEPS,
        committed_steps=committed_steps,
        train_losses=train_losses,
        final_state=final_state,
        assert_bitwise_equal=assert_bitwise_equal,
        wait_until=wait_until,
        free_port=free_port,
        copy_data=copy_data,
    )
