"""`[runtime]`: environment and XLA flags that must be in place before JAX initializes its backend.

The hero needed GPU settings (cuda_async allocator, ragged all-to-all without the NCCL barrier, the
latency-hiding scheduler, a long NCCL termination timeout); they live in the recipe, not in a launch
script, so every host of every run gets the same ones.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from importlib import metadata
from pathlib import Path

from marinctl.errors import UserError
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


# [speed, stop 38] Transparent huge pages for the host heap. glibc's malloc serves XLA:CPU's large step
# buffers with fresh mmaps and unmaps them on free, so every step page-faulted its whole working set in
# again, 4 KiB at a time: the tiny step took ~140,000 minor faults (~550 MB) and ~250 ms of kernel time
# per step on this project's 2-core VMs, a third of the step. With `glibc.malloc.hugetlb=1` malloc
# madvises its memory for transparent huge pages: 2 MiB faults, ~30x fewer (bench/README.md). glibc reads
# tunables only at process start, so the `marinctl` command re-executes itself once with the tunable set
# (`exec_with_host_heap`); MARINCTL_HOST_HEAP=system opts out. Keeping freed memory in the process instead
# (mallopt: no mmap, no trim, one arena) removed the faults in a bare step loop but serialized the
# trainer's threads on the one arena's lock: the README demo took 175 s against 129 s with the defaults.
HOST_HEAP_TUNABLE = "glibc.malloc.hugetlb=1"  # since glibc 2.35
HOST_HEAP_OPT_OUT = "MARINCTL_HOST_HEAP"
HOST_HEAPS = ("mimalloc", "hugepages", "system")  # MARINCTL_HOST_HEAP's values; unset: the first available

# [speed, stops 40-41] The default host heap where its wheel installs (Linux x86-64): Microsoft's mimalloc (the
# `cmeel-mimalloc` wheel) preloaded and told not to hand freed pages back (`MIMALLOC_PURGE_DELAY=-1`), so a
# step reuses the last step's pages and nothing is faulted in or zeroed again. On the tiny step (2-core VM):
# kernel time 10.3% of the CPU under huge-page glibc against 1.6% (perf), the step 1.11x faster
# (bench/ab_heap.py, five alternated rounds). mimalloc's own default purging still faulted ~2,000 pages per
# step in (14% of the CPU in the kernel). A heap that never purges keeps the high-water mark of everything
# the process ran: the demo's peak RSS reached 5.9 GB against 2.4 GB (stop 40), so the trainer hands pages
# back around the work that is not the step loop (`host_pages_released`: compiles, evals, checkpoints,
# schedule changes) and keeps them only while steps run (bench/README.md, stop 41).
MIMALLOC_PACKAGE = "cmeel-mimalloc"
MIMALLOC_ENV = {"MIMALLOC_PURGE_DELAY": "-1"}
# Every variable a host heap sets: what a benchmark clears to start a process on a heap of its own choosing.
HOST_HEAP_ENV = ("GLIBC_TUNABLES", "LD_PRELOAD", *MIMALLOC_ENV)


def mimalloc_library() -> Path | None:
    """The shared library of the installed `cmeel-mimalloc` wheel, or None without it."""
    try:
        files = metadata.files(MIMALLOC_PACKAGE) or []
    except metadata.PackageNotFoundError:
        return None
    found = sorted(f for f in files if re.fullmatch(r"libmimalloc\.so(\.\d+)*", f.name))
    return Path(str(found[0].locate())).resolve() if found else None


def host_heap_environ(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment to re-execute with for the host heap `MARINCTL_HOST_HEAP` names (unset: mimalloc where
    its wheel is installed, else hugepages), or None when there is nothing to change: already in place,
    `system`, or (hugepages) not glibc >= 2.35 or transparent huge pages off in this kernel. An unknown value,
    or mimalloc asked for without its package, is a `UserError`."""
    asked = environ.get(HOST_HEAP_OPT_OUT, "")
    if asked and asked not in HOST_HEAPS:
        raise UserError(f"{HOST_HEAP_OPT_OUT}={asked!r}: expected one of {', '.join(HOST_HEAPS)}")
    preload = environ.get("LD_PRELOAD", "")
    tunables = environ.get("GLIBC_TUNABLES", "")
    if asked == "system" or "libmimalloc" in preload:
        return None
    library = mimalloc_library() if asked in ("", "mimalloc") else None  # looked up once, only when it may be used
    choice = asked or ("mimalloc" if library else "hugepages")
    if choice == "mimalloc":
        if library is None:
            raise UserError(
                f"{HOST_HEAP_OPT_OUT}=mimalloc: the {MIMALLOC_PACKAGE} package is not installed "
                f"(pip install {MIMALLOC_PACKAGE}; Linux x86-64 wheels)"
            )
        return {**MIMALLOC_ENV, **environ, "LD_PRELOAD": ":".join(filter(None, [str(library), preload]))}
    if "glibc.malloc.hugetlb=" in tunables:
        return None
    libc = os.confstr("CS_GNU_LIBC_VERSION") if "CS_GNU_LIBC_VERSION" in os.confstr_names else None
    match = re.fullmatch(r"glibc (\d+)\.(\d+).*", libc or "")
    if match is None or (int(match[1]), int(match[2])) < (2, 35):
        return None
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    if "[never]" in thp:
        return None
    return {**environ, "GLIBC_TUNABLES": ":".join(filter(None, [tunables, HOST_HEAP_TUNABLE]))}


def exec_with_host_heap() -> None:
    """Re-execute this process's command line with the host heap, once, before anything runs.

    Only entry points call this (`marinctl`, the bench scripts): the command line is replayed from
    `sys.orig_argv`, so the process keeps its PID, its signals and its arguments. A bad
    `MARINCTL_HOST_HEAP` prints one line and exits 2."""
    try:
        environ = host_heap_environ(os.environ)
    except UserError as err:
        print(f"marinctl: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    if environ is None:
        return
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
    except OSError as err:  # the process goes on with libc's defaults
        log.debug("could not re-execute with the %s host heap: %s", os.environ.get(HOST_HEAP_OPT_OUT), err)


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


# mimalloc.h's `mi_option_purge_delay` (the same index from v2.1 through v3.4). `_mimalloc` only trusts it after
# reading back the -1 the re-execution set, so a renumbered enum leaves the heap alone instead of misconfiguring it.
MI_OPTION_PURGE_DELAY = 15


class _HostPages:
    """How many threads are inside `host_pages_released` (a compile on the precompile thread can overlap an
    eval on the main one): the purge delay goes to 0 with the first and back to -1 with the last."""

    lock = threading.Lock()
    releasers = 0
    library: ctypes.CDLL | bool | None = False  # False: not looked up yet


def _mimalloc() -> ctypes.CDLL | None:
    """The preloaded mimalloc, when this process runs on it with freed pages kept (purge delay -1)."""
    if _HostPages.library is False:
        library = None
        try:
            process = ctypes.CDLL(None)  # LD_PRELOAD's symbols are global: mi_* resolve only under mimalloc
            get, put, collect = process.mi_option_get, process.mi_option_set, process.mi_collect
        except (OSError, AttributeError):
            pass
        else:
            get.argtypes, get.restype = [ctypes.c_int], ctypes.c_long
            put.argtypes, put.restype = [ctypes.c_int, ctypes.c_long], None
            collect.argtypes, collect.restype = [ctypes.c_bool], None
            if get(MI_OPTION_PURGE_DELAY) == -1:
                library = process
        _HostPages.library = library
    return _HostPages.library or None


def host_pages_held() -> bool | None:
    """Whether freed host pages stay in the process now: None off mimalloc (glibc hands large buffers back)."""
    library = _mimalloc()
    return None if library is None else library.mi_option_get(MI_OPTION_PURGE_DELAY) < 0


def describe_host_heap(environ: Mapping[str, str] = os.environ) -> str:
    """This process's host heap in a few words, for the run header (a user reading a slow or a large run
    wants to know which heap it had)."""
    if _mimalloc() is not None:
        return f"mimalloc, freed pages kept while steps run (choose with {HOST_HEAP_OPT_OUT})"
    if "libmimalloc" in environ.get("LD_PRELOAD", ""):
        return f"mimalloc, MIMALLOC_PURGE_DELAY={environ.get('MIMALLOC_PURGE_DELAY', 'default')}"
    if HOST_HEAP_TUNABLE in environ.get("GLIBC_TUNABLES", ""):
        return "glibc malloc, transparent huge pages"
    return "the C library's malloc"


@contextlib.contextmanager
def host_pages_released() -> Iterator[None]:
    """Hand freed host pages back to the OS while the body runs; keep them again after it.

    Kept pages are what make XLA:CPU's step loop cheap (no page faults, no zeroing), but everything else a
    run does (compiles, evals, checkpoint writes, schedule changes) would leave its own high-water mark
    behind for good. Wraps those; the step loop runs outside it. Off mimalloc this does nothing. Nests,
    and overlaps across threads: pages are kept again when the last body ends, after a forced collect
    hands back what the bodies freed."""
    library = _mimalloc()
    if library is None:
        yield
        return
    with _HostPages.lock:
        _HostPages.releasers += 1
        if _HostPages.releasers == 1:
            library.mi_option_set(MI_OPTION_PURGE_DELAY, 0)  # 0: every free from here on is purged at once
    try:
        yield
    finally:
        with _HostPages.lock:
            _HostPages.releasers -= 1
            if _HostPages.releasers == 0:
                library.mi_collect(True)
                library.mi_option_set(MI_OPTION_PURGE_DELAY, -1)


def _backend_initialized() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except Exception:  # private API moved: assume started, which only costs a warning
        return True
