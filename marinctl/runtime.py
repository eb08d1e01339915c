"""`[runtime]`: environment and XLA flags that must be in place before JAX initializes its backend.

The hero needed GPU settings (cuda_async allocator, ragged all-to-all without the NCCL barrier, the
latency-hiding scheduler, a long NCCL termination timeout); they live in the recipe, not in a launch
script, so every host of every run gets the same ones.
"""

from __future__ import annotations

import ctypes
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
#
# [speed, issue 10] Matrix products through XLA:CPU's own (Eigen) dot emitter instead of YNNPACK library
# fusions. YNNPACK runs a batched dot one small matrix after another on one core: Newton-Schulz's
# [64, 128, 128] stacks, attention's per-head products and the expert tiles ran at ~30 GFLOP/s against a
# ~120 GFLOP/s machine peak. Eigen spreads them over the cores: +15-30% tokens/s on the tiny and
# MaxText-shape steps (bench/README.md). One 1024² product is ~10% faster through YNNPACK, so the MFU
# peak is measured both ways and the faster counts (`marinctl.train.metrics.measure_matmul_peak`).
YNN_DOTS_OFF = "--xla_cpu_experimental_ynn_fusion_type=-dot,-individual_dot"
CPU_DEFAULT_XLA_FLAGS = ("--xla_cpu_enable_concurrency_optimized_scheduler=false", YNN_DOTS_OFF)


# [speed, stop 38] glibc's malloc gave XLA:CPU's step buffers back to the kernel after every step. Blocks
# past the mmap threshold are unmapped on free, the worker threads' arenas shrink their heaps, and the main
# heap is trimmed. Each step then page-faulted and zeroed its whole working set again: the tiny step took
# ~140,000 minor faults (~550 MB) and ~250 ms of kernel time per step, a third of its wall time
# (bench/README.md). `host_heap = "retain"` keeps freed memory in the process: no mmap for large blocks, no
# trimming, and one arena. XLA's worker threads then reuse the main heap instead of growing and shrinking
# arenas of their own. A thread picks its arena at its first allocation, so this must run before the
# backend starts its thread pools. The cost is RSS that stays at its peak, which a training process
# reaches every step anyway.
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8  # glibc's <malloc.h>
# (mallopt parameter, value, the same setting as a glibc tunable for a process marinctl only launches)
_HEAP_SETTINGS = (
    (M_MMAP_MAX, 0, "glibc.malloc.mmap_max"),
    (M_TRIM_THRESHOLD, 2**31 - 1, "glibc.malloc.trim_threshold"),
    (M_ARENA_MAX, 1, "glibc.malloc.arena_max"),
)
RETAIN_HEAP_TUNABLES = ":".join(f"{name}={value}" for _, value, name in _HEAP_SETTINGS)  # for GLIBC_TUNABLES
_heap_retained = False


def retain_host_heap() -> bool:
    """Keep freed host memory in this process (glibc only). Returns whether the settings took."""
    global _heap_retained
    if _heap_retained:
        return True
    libc = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in os.confstr_names else None
    if not libc or not libc.startswith("glibc"):
        return False
    mallopt = ctypes.CDLL(None).mallopt
    _heap_retained = all(mallopt(param, value) == 1 for param, value, _ in _HEAP_SETTINGS)
    return _heap_retained


def apply_runtime(runtime: RuntimeConfig) -> None:
    backend_started = "jax" in sys.modules and _backend_initialized()
    if backend_started and (runtime.env or runtime.xla_flags):
        log.warning("JAX already started: [runtime] settings apply to new processes only")
    if runtime.host_heap == "retain" and not backend_started and not retain_host_heap():
        log.debug("host_heap = retain: not a glibc process, malloc left as it is")
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
