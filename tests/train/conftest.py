"""Shared set-up for the trainer's tests: one micro recipe (expert parallelism, fixed capacity, QB),
the built-in corpus built once, and one persistent XLA cache, so the train step is compiled once and
every subprocess run reuses it."""

import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

STEPS = 24


@pytest.fixture(scope="session")
def train_env(subprocess_env):
    """Environment for trainer subprocesses: 8 CPU devices, the session's compilation cache."""
    return subprocess_env


@pytest.fixture(scope="session")
def micro_recipe_path(micro_run_recipe):
    """tests/micro.toml with this suite's steps, a checkpoint every 5 steps, no in-loop eval."""
    return micro_run_recipe(steps=STEPS, checkpoint_every=5, eval_every=0, norms_every=10)


class Runner:
    """`marinctl` as a subprocess, with the shared environment, plus the polling the signal tests need."""

    def __init__(self, env: dict, process):
        self.env, (self._launch, self._finish) = env, process

    def launch(self, args: list[str], env: dict | None = None) -> subprocess.Popen:
        return self._launch(args, {**self.env, **(env or {})})

    def finish(self, proc: subprocess.Popen, timeout: float = 400) -> tuple[int, dict | None, str]:
        """(exit code, the --json summary or None, stderr)."""
        rc, summary, _, err = self._finish(proc, timeout)
        return rc, summary, err

    @staticmethod
    def committed_steps(run_dir: Path) -> list[int]:
        ckpt = run_dir / "checkpoints"
        return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.is_dir() else []

    def wait_for_checkpoint(self, proc: subprocess.Popen, run_dir: Path, timeout: float = 400) -> int:
        """Block until the run has published a checkpoint (orbax renames it into place when complete)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            steps = self.committed_steps(run_dir)
            if steps:
                return steps[0]
            if proc.poll() is not None:
                _, err = proc.communicate()
                raise AssertionError(f"run ended (rc {proc.returncode}) before its first checkpoint:\n{err[-3000:]}")
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        raise AssertionError("no checkpoint within the timeout")

    @staticmethod
    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


@pytest.fixture(scope="session")
def runner(train_env, marinctl_process) -> Runner:
    return Runner(train_env, marinctl_process)
