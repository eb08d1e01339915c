"""Shared set-up for the trainer's tests: one micro recipe (expert parallelism, fixed capacity, QB),
the built-in corpus built once, and one persistent XLA cache, so the train step is compiled once and
every subprocess run reuses it."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# tests/micro.toml (shared with tests/stages) plus this run's steps, data, checkpoint and eval cadence.
MICRO = """
extends = "{micro}"

[train]
steps = {steps}

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
norms_every = 10
"""

STEPS = 24


@pytest.fixture(scope="session")
def train_env(tmp_path_factory):
    """Environment for trainer subprocesses (and this process): 8 CPU devices, one compilation cache."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    cache = tmp_path_factory.mktemp("xla_cache")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    jax.config.update("jax_compilation_cache_dir", str(cache))
    compilation_cache.reset_cache()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "NO_COLOR": "1", "PYTHONUNBUFFERED": "1"}
    return env


@pytest.fixture(scope="session")
def micro_recipe_path(tmp_path_factory, train_env):
    from marinctl.data.builtin import ensure_builtin_corpus
    from marinctl.recipe import load_recipe

    root = tmp_path_factory.mktemp("micro")
    path = root / "micro.toml"
    path.write_text(MICRO.format(micro=REPO / "tests" / "micro.toml", data=root / "data", steps=STEPS))
    ensure_builtin_corpus(load_recipe(path))  # once, before any run races to build it
    return path


class Runner:
    """`marinctl` as a subprocess, with the shared environment, plus the polling the signal tests need."""

    def __init__(self, env: dict):
        self.env = env

    def launch(self, args: list[str], env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "marinctl.cli", *args],
            env={**self.env, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    @staticmethod
    def finish(proc: subprocess.Popen, timeout: float = 400) -> tuple[int, dict | None, str]:
        """(exit code, the --json summary or None, stderr)."""
        out, err = proc.communicate(timeout=timeout)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        return proc.returncode, (json.loads(lines[-1]) if lines else None), err

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
def runner(train_env) -> Runner:
    return Runner(train_env)
