"""`[runtime]`: environment and XLA flags that must be in place before JAX initializes its backend.

The hero needed GPU settings (cuda_async allocator, ragged all-to-all without the NCCL barrier, the
latency-hiding scheduler, a long NCCL termination timeout); they live in the recipe, not in a launch
script, so every host of every run gets the same ones.
"""

from __future__ import annotations

import logging
import os
import sys

from marinctl.recipe import RuntimeConfig

log = logging.getLogger(__name__)


# [faults, issue 14] XLA:CPU defaults every run gets unless XLA_FLAGS or the recipe says otherwise.
# The concurrency-optimized (BFS) scheduler lets the CPU thunk executor run independent collectives of one
# step concurrently; on simulated multi-device meshes (and 2x4 gloo) devices then entered an all-reduce over
# all 8 devices and an all-gather over the data axis in different orders and XLA's rendezvous aborted the
# run (exit 134, 5 of 6 tiny-recipe runs on data 2 x expert 4). The memory-minimizing DFS schedule keeps one
# collective order on every device; the flag only touches XLA:CPU compilation, so GPU programs are unchanged.
# tests/faults/test_collectives.py repeats the failing pattern to hold this in place.
CPU_DEFAULT_XLA_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false",)


def apply_runtime(runtime: RuntimeConfig) -> None:
    backend_started = "jax" in sys.modules and _backend_initialized()
    if backend_started and (runtime.env or runtime.xla_flags):
        log.warning("JAX already started: [runtime] settings apply to new processes only")
    for key, value in runtime.env.items():
        os.environ.setdefault(key, value)  # an explicit environment wins over the recipe
    flags = [*runtime.xla_flags, *CPU_DEFAULT_XLA_FLAGS]  # the recipe's first: it wins over the CPU defaults
    present = os.environ.get("XLA_FLAGS", "").split()
    names = {flag.split("=", 1)[0] for flag in present}
    extra = []
    for flag in flags:
        if flag.split("=", 1)[0] not in names:
            names.add(flag.split("=", 1)[0])
            extra.append(flag)
    if extra:
        os.environ["XLA_FLAGS"] = " ".join([*present, *extra]).strip()


def _backend_initialized() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except Exception:  # private API moved: assume started, which only costs a warning
        return True
