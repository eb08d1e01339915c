"""Multi-host start-up: JAX's own distributed runtime, configured from flags, env vars or SLURM.

Precedence: explicit flags, then `MARINCTL_COORDINATOR` / `MARINCTL_NUM_PROCESSES` / `MARINCTL_PROCESS_ID`,
then SLURM (`SLURM_NTASKS`, `SLURM_PROCID`, the first host of `SLURM_STEP_NODELIST`, port
`MARINCTL_COORDINATOR_PORT` or one derived from `SLURM_JOB_ID`, as JAX's own SLURM detection does). A single
process needs no runtime. On CPU the cross-process collectives go through gloo.
"""

from __future__ import annotations

import logging
import os
import re
import signal
from collections.abc import Mapping
from dataclasses import dataclass

from marinctl.errors import UserError

log = logging.getLogger(__name__)

DEFAULT_PORT = 12345


@dataclass(frozen=True)
class DistributedConfig:
    coordinator: str  # host:port of process 0
    num_processes: int
    process_id: int
    source: str  # "flags", "env" or "slurm": named in errors and the run header


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list: 'gpu[003-010,012],cpu1' -> 'gpu003' (zero padding kept)."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not match or not match.group(1):
        raise UserError(f"SLURM node list {nodelist!r}: cannot read the first host")
    prefix, ranges = match.group(1), match.group(3)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def resolve_distributed(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    env: Mapping[str, str] | None = None,
) -> DistributedConfig | None:
    """The runtime configuration for this process, or None for a single-process run."""
    env = os.environ if env is None else env
    if (coordinator, num_processes, process_id) != (None, None, None):
        source = "flags"
    elif any(env.get(f"MARINCTL_{k}") for k in ("COORDINATOR", "NUM_PROCESSES", "PROCESS_ID")):
        coordinator = env.get("MARINCTL_COORDINATOR") or None
        num_processes = _int_env(env, "MARINCTL_NUM_PROCESSES")
        process_id = _int_env(env, "MARINCTL_PROCESS_ID")
        source = "env"
    elif "SLURM_PROCID" in env:
        return _from_slurm(env)
    else:
        return None
    if num_processes is None:
        raise UserError(f"distributed ({source}): the number of processes is not set (--num-processes)")
    if num_processes < 1:
        raise UserError(f"distributed ({source}): number of processes must be ≥ 1 (got {num_processes})")
    if num_processes == 1:
        return None
    if coordinator is None or process_id is None:
        missing = "the coordinator address" if coordinator is None else "the process id"
        raise UserError(f"distributed ({source}): {num_processes} processes but {missing} is not set")
    if not 0 <= process_id < num_processes:
        raise UserError(f"distributed ({source}): process id {process_id} is outside 0..{num_processes - 1}")
    if ":" not in coordinator:
        coordinator = f"{coordinator}:{DEFAULT_PORT}"
    return DistributedConfig(coordinator, num_processes, process_id, source)


def _from_slurm(env: Mapping[str, str]) -> DistributedConfig | None:
    ntasks = _int_env(env, "SLURM_STEP_NUM_TASKS") or _int_env(env, "SLURM_NTASKS") or 1
    if ntasks == 1:
        return None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise UserError("SLURM: SLURM_PROCID is set but no SLURM_STEP_NODELIST / SLURM_JOB_NODELIST")
    port = _int_env(env, "MARINCTL_COORDINATOR_PORT")
    if port is None:
        job = _int_env(env, "SLURM_JOB_ID") or 0
        port = DEFAULT_PORT + job % 1000  # distinct per job, so jobs sharing a node do not collide
    process_id = _int_env(env, "SLURM_PROCID")
    assert process_id is not None
    return DistributedConfig(f"{first_slurm_host(nodelist)}:{port}", ntasks, process_id, "slurm")


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"environment variable {name}={raw!r} is not an integer") from None


def initialize(config: DistributedConfig | None, run_dir: str = "") -> None:
    """Start JAX's distributed runtime (before any other JAX call touches the devices)."""
    import jax

    if config is None:
        return
    _say_what_to_do_on_abort(config, run_dir)
    # XLA:CPU has no cross-process collectives of its own; gloo carries them over TCP (GPU runs ignore it).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    log.info(
        "jax.distributed: process %d of %d, coordinator %s (%s)",
        config.process_id,
        config.num_processes,
        config.coordinator,
        config.source,
    )
    # A process that dies (SIGKILL, OOM, a lost node) stops heartbeating; after this many seconds the
    # coordination service fails the job and every survivor exits non-zero instead of waiting forever in a
    # collective. JAX's default is 100 s; MARINCTL_HEARTBEAT_TIMEOUT_S overrides it (the fault tests use 10).
    heartbeat = _int_env(os.environ, "MARINCTL_HEARTBEAT_TIMEOUT_S") or 100
    jax.distributed.initialize(
        coordinator_address=config.coordinator,
        num_processes=config.num_processes,
        process_id=config.process_id,
        heartbeat_timeout_seconds=heartbeat,
    )


# Kept alive for the life of the process: the C handler below calls into it.
_ABORT_HANDLER: object = None


def _say_what_to_do_on_abort(config: DistributedConfig, run_dir: str) -> None:
    """When another process of the run dies, JAX's coordination service ends every survivor with a fatal
    log line ("... stopped sending heartbeats: <task>") and a C++ stack trace, then abort(). Python cannot
    catch that, and the runtime's missed-heartbeat callback cannot be replaced from Python (the binding
    rejects it), so a C-level SIGABRT handler adds the operator's line as the last thing in the log and exits
    1 instead of dumping core. The handler runs in the aborting thread and takes the GIL (ctypes does), so it
    does nothing else: the message is built here, ahead of time, and it only writes it and exits."""
    import ctypes

    global _ABORT_HANDLER
    n = config.num_processes
    message = (
        f"marinctl: process {config.process_id} of {n} was aborted by the XLA runtime (its 'F' line above says "
        f"why; 'stopped sending heartbeats' or 'Failed to send RPC to coordination service' means another "
        f"process of this run died). Relaunch all {n} processes with the same command: the run resumes from its "
        f"newest checkpoint" + (f" in {run_dir}" if run_dir else "") + ".\n"
    ).encode()

    def on_abort(signum: int) -> None:
        os.write(2, message)
        os._exit(1)

    handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)
    _ABORT_HANDLER = handler_type(on_abort)
    libc = ctypes.CDLL(None)
    libc.signal.argtypes = [ctypes.c_int, handler_type]
    libc.signal.restype = ctypes.c_void_p
    libc.signal(signal.SIGABRT, _ABORT_HANDLER)
