"""Test set-up: 8 simulated CPU devices for the multi-device tests, set before anything imports JAX."""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("NO_COLOR", "1")

import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from marinctl.recipe import RuntimeConfig
from marinctl.runtime import apply_runtime, host_heap_environ

# The CPU defaults `marinctl` applies, merged by the same rule, for in-process runs too, so in-process results
# equal a `marinctl` subprocess's (none of the imports above starts JAX).
apply_runtime(RuntimeConfig())
# `marinctl` subprocesses start with the huge-page malloc they would re-execute themselves for.
os.environ.update(host_heap_environ(os.environ) or {})

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"


@pytest.fixture(scope="session")
def tiny_recipe():
    from marinctl.recipe import load_recipe

    return load_recipe(RECIPES / "tiny.toml")


@pytest.fixture(scope="session")
def hero_recipe():
    from marinctl.recipe import load_recipe

    return load_recipe(RECIPES / "hero.toml")


# --------------------------------------------------------------------------------------------------
# Runs of tests/micro.toml in subprocesses (tests/train, tests/faults, tests/schedule, tests/stages).

MICRO_RUN = """
extends = "{micro}"

[train]
steps = {steps}{batch}

[data]
root = "{data}"

[checkpoint]
every = {checkpoint_every}
keep_last = 10

[eval]
every = {eval_every}
batches = 1
batch_size = {eval_batch_size}
{log}"""


@pytest.fixture(scope="session")
def xla_test_cache(tmp_path_factory) -> Path:
    """One persistent XLA cache for the session (or MARINCTL_TEST_XLA_CACHE), for this process and every
    subprocess it starts, so each program compiles once — and never into the user's ~/.cache."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    cache = Path(os.environ.get("MARINCTL_TEST_XLA_CACHE") or tmp_path_factory.mktemp("xla_cache"))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    jax.config.update("jax_compilation_cache_dir", str(cache))
    compilation_cache.reset_cache()
    return cache


@pytest.fixture(scope="session")
def subprocess_env(xla_test_cache) -> dict[str, str]:
    """Environment for `marinctl` subprocesses: 8 CPU devices (above), the session's XLA cache, plain output."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "NO_COLOR": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="session")
def micro_run_recipe(tmp_path_factory, xla_test_cache):
    """`make(steps=, checkpoint_every=, eval_every=0, norms_every=None, batch_size=None, extra="", name=,
    eval_batch_size=8) -> Path`: a
    recipe extending tests/micro.toml with its own data dir (the built-in corpus built once, before any run
    races to build it); `extra` is appended TOML (e.g. [[schedule.changes]])."""
    from marinctl.data.builtin import ensure_builtin_corpus
    from marinctl.recipe import load_recipe

    def make(*, steps: int, checkpoint_every: int, eval_every: int = 0, norms_every: int | None = None,
             batch_size: int | None = None, extra: str = "", name: str = "micro",
             eval_batch_size: int = 8) -> Path:  # fmt: skip
        root = tmp_path_factory.mktemp(name)
        path = root / f"{name}.toml"
        path.write_text(
            MICRO_RUN.format(
                micro=REPO / "tests" / "micro.toml",
                data=root / "data",
                steps=steps,
                batch="" if batch_size is None else f"\nbatch_size = {batch_size}",
                checkpoint_every=checkpoint_every,
                eval_every=eval_every,
                eval_batch_size=eval_batch_size,
                log="" if norms_every is None else f"\n[log]\nnorms_every = {norms_every}\n",
            )
            + extra
        )
        ensure_builtin_corpus(load_recipe(path))
        return path

    return make


def finish_process(proc: subprocess.Popen, timeout: float = 400) -> tuple[int, dict | None, str, str]:
    """(exit code, the last --json summary line or None, stdout, stderr) of a `marinctl` subprocess."""
    out, err = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("{")]
    return proc.returncode, (json.loads(lines[-1]) if lines else None), out, err


def launch_marinctl(args: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "marinctl.cli", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


@pytest.fixture(scope="session")
def marinctl_process():
    """(launch(args, env) -> Popen, finish(proc, timeout) -> (rc, summary, stdout, stderr)) for `marinctl`
    subprocesses (test modules cannot import conftest under the importlib import mode)."""
    return launch_marinctl, finish_process


# --------------------------------------------------------------------------------------------------
# A real single-node SLURM on localhost (tests/faults/test_slurm.py, tests/ladder/test_ladder_e2e.py).

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "srun", "sinfo")

CONF = """ClusterName=marinctl-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# cred_expire is also how long SLURM holds a requeued job before it may start again (default 120 s).
AuthInfo=socket={d}/munge.sock,cred_expire=5
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=60
MinJobAge=3600
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """The cluster's commands, run with its SLURM_CONF."""

    def __init__(self, root: Path, env: dict):
        self.root, self.conf = root, root / "slurm.conf"
        self.env = {**env, "SLURM_CONF": str(self.conf)}

    def with_env(self, env: dict) -> "Cluster":
        """The same cluster, its commands (and so its jobs) run with `env`."""
        return Cluster(self.root, env)

    def run(self, *args: str, check: bool = True) -> str:
        result = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=60)
        if check and result.returncode:
            raise AssertionError(f"{' '.join(args)}: {result.stderr}")
        return result.stdout

    def job(self, job_id: str) -> dict[str, str]:
        text = self.run("scontrol", "show", "job", job_id, "-o", check=False)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_job(self, job_id: str, predicate, timeout: float, what: str) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if predicate(info):
                return info
            time.sleep(0.5)
        raise AssertionError(f"job {job_id}: not {what} within {timeout}s: {self.job(job_id)}")

    def sbatch(self, script: str, *options: str) -> str:
        path = self.root / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        log = f"--output={self.root}/%j.out"  # appended to across requeues
        out = self.run("sbatch", "--parsable", f"--chdir={REPO}", log, "--open-mode=append", *options, str(path))
        return out.strip().split(";")[0]


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running one-node SLURM cluster on localhost for the session (its own config, state, spool and munge
    key under a temp dir; stopped by pid at the end). Skips, saying why, where slurm-wlm/munge are absent."""
    path = f"/usr/sbin:{os.environ.get('PATH', '')}"
    missing = [b for b in BINARIES if shutil.which(b, path=path) is None]
    if missing:
        pytest.skip(f"SLURM not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the single-node SLURM cluster runs its daemons as root (CI runs as root)")
    d = Path(tempfile_dir := str(tmp_path_factory.mktemp("slurm")))
    for sub in ("state", "spool"):
        (d / sub).mkdir()
    os.chmod(d, 0o755)  # munged wants its socket directory reachable
    key = d / "munge.key"
    daemon_env = {**os.environ, "PATH": path}
    subprocess.run(["mungekey", "-c", "-k", str(key)], check=True, capture_output=True, env=daemon_env)
    os.chmod(key, 0o600)
    subprocess.run(
        ["munged", "-f", f"--socket={d}/munge.sock", f"--key-file={key}", f"--log-file={d}/munged.log",
         f"--pid-file={d}/munged.pid", f"--seed-file={d}/munged.seed"],
        check=True, capture_output=True, env=daemon_env,
    )  # fmt: skip
    host = socket.gethostname()
    conf = CONF.format(host=host, d=tempfile_dir, ctld_port=_free_port(), d_port=_free_port(), cpus=os.cpu_count())
    (d / "slurm.conf").write_text(conf)
    c = Cluster(d, daemon_env)
    pids = [d / "munged.pid"]
    try:
        c.run("slurmctld", "-i", "-f", str(d / "slurm.conf"))
        pids.append(d / "slurmctld.pid")
        c.run("slurmd", "-f", str(d / "slurm.conf"))
        pids.append(d / "slurmd.pid")
        deadline = time.monotonic() + 60
        while "idle" not in c.run("sinfo", "-h", "-o", "%T", check=False):
            assert time.monotonic() < deadline, (d / "slurmctld.log").read_text()[-3000:]
            time.sleep(0.5)
        yield c
    finally:
        for job in c.run("squeue", "-h", "-o", "%i", check=False).split():
            c.run("scancel", job, check=False)
        for pidfile in reversed(pids):  # stop our daemons by their pids, nothing else
            if pidfile.exists():
                try:
                    os.kill(int(pidfile.read_text().split()[0]), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass
        time.sleep(1)
