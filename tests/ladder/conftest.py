"""A real single-node SLURM on localhost for the `ladder run --sbatch` test: munged, slurmctld and slurmd
from Debian's slurm-wlm + munge, each started in the foreground under a private directory with private
ports, so it neither needs nor touches a system configuration. Skips when the binaries are absent (the
fake-`sbatch` tests in test_ladder_stage.py cover the scripts and the submission without it)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

SLURM_CONF = """\
ClusterName=marinctl-ladder
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge/munge.sock
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
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
KillWait=20
MinJobAge=600
InactiveLimit=0
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=ladder Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise RuntimeError(f"SLURM fixture: {what} within {timeout:.0f}s")


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    """Environment (SLURM_CONF and PATH) of a running one-node cluster; torn down after the session."""
    tools = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol")
    paths = {t: shutil.which(t) or (f"/usr/sbin/{t}" if Path(f"/usr/sbin/{t}").exists() else None) for t in tools}
    if any(p is None for p in paths.values()) or os.geteuid() != 0:
        pytest.skip("SLURM (slurm-wlm + munge) is not installed here, or not running as root")
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool", "log"):
        (root / sub).mkdir()
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    host = socket.gethostname().split(".")[0]
    conf = root / "slurm.conf"
    conf.write_text(SLURM_CONF.format(host=host, root=root, ctld_port=_free_port(), d_port=_free_port(),
                                      cpus=os.cpu_count() or 1))  # fmt: skip
    env = {**os.environ, "SLURM_CONF": str(conf), "PATH": f"/usr/sbin:{os.environ.get('PATH', '')}"}
    daemons: list[subprocess.Popen] = []

    def start(*argv: str) -> None:
        log = open(root / "log" / f"{Path(argv[0]).name}.stdout", "w")  # open as long as the daemon runs
        daemons.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))

    try:
        start(paths["munged"], "-F", "-f", f"--socket={root}/munge/munge.sock", f"--key-file={key}",
              f"--log-file={root}/log/munged.log", f"--pid-file={root}/munge/munged.pid",
              f"--seed-file={root}/munge/seed")  # fmt: skip
        _wait(lambda: (root / "munge" / "munge.sock").exists(), 20, "munged did not open its socket")
        start(paths["slurmctld"], "-D", "-i", "-f", str(conf))
        start(paths["slurmd"], "-D", "-f", str(conf), "-N", host)

        def node_idle() -> bool:
            done = subprocess.run([paths["sinfo"], "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            return done.returncode == 0 and done.stdout.strip() in ("idle", "mix", "alloc")

        _wait(node_idle, 60, "the node did not come up idle")
    except BaseException:
        _stop(daemons)
        raise
    yield env
    _stop(daemons)


def _stop(daemons: list[subprocess.Popen]) -> None:
    for proc in reversed(daemons):  # slurmd, slurmctld, then munged
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
