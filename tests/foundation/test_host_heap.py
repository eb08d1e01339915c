"""`runtime.host_heap` (stop 38): with glibc's defaults every XLA:CPU step page-faulted its buffers in again
(the tiny step: ~140,000 minor faults, ~250 ms of kernel time per step). "retain" keeps freed memory in
the process. Each case runs in a fresh interpreter, because the setting must precede JAX's thread pools."""

import os
import subprocess
import sys

import pytest

PROBE = """
import resource, sys
from marinctl.recipe import RuntimeConfig
from marinctl.runtime import apply_runtime
apply_runtime(RuntimeConfig(host_heap=sys.argv[1]))
import jax, jax.numpy as jnp
x = jnp.ones((4096, 4096), jnp.float32)
double = jax.jit(lambda x: x * 2.0)  # a fresh 64 MB output every call: past glibc's largest mmap threshold
faults = []
for _ in range(16):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    double(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults[8:])  # once the heap holds the working set (outputs are freed a few calls late)
"""

glibc = (
    (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    if "CS_GNU_LIBC_VERSION" in os.confstr_names
    else False
)


def faults_per_call(host_heap: str, tunables: str | None = None) -> list[int]:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MALLOC_ARENA_MAX")}
    if tunables:
        env["GLIBC_TUNABLES"] = tunables
    done = subprocess.run(
        [sys.executable, "-c", PROBE, host_heap], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return sorted(int(n) for n in done.stdout.split())


@pytest.mark.skipif(not glibc, reason="host_heap acts on glibc's malloc only")
def test_a_retained_heap_reuses_a_steps_buffers_where_the_system_default_faults_them_in_again():
    pages = 4096 * 4096 * 4 // os.sysconf("SC_PAGE_SIZE")
    system, retain = faults_per_call("system"), faults_per_call("retain")
    median = len(system) // 2
    assert system[median] >= pages // 2, system  # each call maps its 64 MB output anew and touches every page
    assert retain[median] <= pages // 100, retain  # the same memory, already resident


@pytest.mark.skipif(not glibc, reason="host_heap acts on glibc's malloc only")
def test_the_tunables_given_to_a_launched_process_retain_its_heap_the_same_way():
    from marinctl.runtime import RETAIN_HEAP_TUNABLES  # bench/compare_maxtext.py gives MaxText these

    pages = 4096 * 4096 * 4 // os.sysconf("SC_PAGE_SIZE")
    faults = faults_per_call("system", RETAIN_HEAP_TUNABLES)
    assert faults[len(faults) // 2] <= pages // 100, faults


def test_host_heap_is_validated():
    from marinctl.errors import UserError
    from marinctl.recipe import load_recipe

    with pytest.raises(UserError, match=r"runtime\.host_heap"):
        load_recipe(os.path.join(os.path.dirname(__file__), "..", "micro.toml"), ["runtime.host_heap=some"])
