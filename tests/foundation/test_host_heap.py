"""The host heap (stops 38, 40, 41): with glibc's defaults every XLA:CPU step page-faulted its buffers in again,
4 KiB at a time (the tiny step: ~140,000 minor faults, ~250 ms of kernel time per step). The `marinctl`
command re-executes itself once with mimalloc preloaded and told to keep freed pages (the default where its
wheel installs), or with `glibc.malloc.hugetlb=1` (`MARINCTL_HOST_HEAP=hugepages`). The trainer hands pages
back around everything but the step loop (`host_pages_released`). Each case runs in a fresh interpreter,
because glibc reads its tunables, and the dynamic loader LD_PRELOAD, only at process start."""

import os
import subprocess
import sys

import pytest

from marinctl.errors import UserError
from marinctl.runtime import (
    HOST_HEAP_ENV,
    HOST_HEAP_OPT_OUT,
    HOST_HEAP_TUNABLE,
    describe_host_heap,
    host_heap_environ,
    host_pages_held,
    host_pages_released,
    mimalloc_library,
)

PROBE = """
import resource
import jax, jax.numpy as jnp
x = jnp.ones((4096, 4096), jnp.float32)
double = jax.jit(lambda x: x * 2.0)  # a fresh 64 MB output every call: past glibc's largest mmap threshold
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    double(x).block_until_ready()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults[4:])
"""


def clean_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (*HOST_HEAP_ENV, HOST_HEAP_OPT_OUT)}


def huge_page_environ() -> dict[str, str] | None:
    return host_heap_environ({**clean_environ(), HOST_HEAP_OPT_OUT: "hugepages"})


huge_pages = pytest.mark.skipif(huge_page_environ() is None, reason="needs glibc >= 2.35 and transparent huge pages")


with_mimalloc = pytest.mark.skipif(mimalloc_library() is None, reason="needs the cmeel-mimalloc wheel (Linux x86-64)")


def median_faults(environ: dict[str, str]) -> int:
    done = subprocess.run([sys.executable, "-c", PROBE], env=environ, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    faults = sorted(int(n) for n in done.stdout.split())
    return faults[len(faults) // 2]


@huge_pages
def test_huge_page_malloc_faults_a_fresh_step_buffer_in_far_fewer_times():
    pages = 4096 * 4096 * 4 // os.sysconf("SC_PAGE_SIZE")
    default = median_faults(clean_environ())
    huge = median_faults(huge_page_environ())
    assert default >= pages // 2, default  # each call maps its 64 MB output anew and touches every 4 KiB page
    assert huge <= default // 4, (huge, default)  # 2 MiB pages: ~30x fewer on this project's machines


@with_mimalloc
def test_mimalloc_that_keeps_its_pages_faults_a_step_buffer_in_only_once():
    pages = 4096 * 4096 * 4 // os.sysconf("SC_PAGE_SIZE")
    mimalloc = median_faults(host_heap_environ(clean_environ()))  # the default where the wheel installs
    default = median_faults(clean_environ())
    assert default >= pages // 2, default  # glibc maps each call's 64 MB output anew
    assert mimalloc <= pages // 100, (mimalloc, default)  # mimalloc reuses the last call's pages: ~no faults


ENTRY = """
import os, sys
print(os.getpid(), os.environ.get("GLIBC_TUNABLES", ""), flush=True)
sys.argv = ["marinctl", "--version"]
from marinctl.cli import main
main()
"""


@huge_pages
def test_the_marinctl_command_re_executes_itself_once_with_huge_page_malloc():
    environ = {**clean_environ(), HOST_HEAP_OPT_OUT: "hugepages", "GLIBC_TUNABLES": "glibc.malloc.perturb=0"}
    done = subprocess.run([sys.executable, "-c", ENTRY], env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    starts = [line.split(" ", 1) for line in done.stdout.splitlines() if not line.startswith("marinctl")]
    assert [tunables for _, tunables in starts] == [
        "glibc.malloc.perturb=0",
        f"glibc.malloc.perturb=0:{HOST_HEAP_TUNABLE}",
    ]
    assert starts[0][0] == starts[1][0]  # the same process (exec), so a scheduler's signals still reach it
    assert done.stdout.splitlines()[-1].startswith("marinctl ")

    opted_out = {**clean_environ(), HOST_HEAP_OPT_OUT: "system"}
    done = subprocess.run([sys.executable, "-c", ENTRY], env=opted_out, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 2, done.stdout  # ran once, as it was


def test_the_environment_is_left_alone_where_it_already_says():
    hugetlb_off = {HOST_HEAP_OPT_OUT: "hugepages", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert host_heap_environ(hugetlb_off) is None  # the user's choice wins
    assert host_heap_environ({HOST_HEAP_OPT_OUT: "system"}) is None


@with_mimalloc
def test_the_marinctl_command_preloads_mimalloc_once_by_default():
    environ = clean_environ()
    entry = ENTRY.replace('os.environ.get("GLIBC_TUNABLES", "")', 'os.environ.get("LD_PRELOAD", "")')
    done = subprocess.run([sys.executable, "-c", entry], env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    starts = [line.split(" ", 1) for line in done.stdout.splitlines() if not line.startswith("marinctl")]
    assert [preload for _, preload in starts] == ["", str(mimalloc_library())]
    assert starts[0][0] == starts[1][0]
    assert host_heap_environ(environ)["MIMALLOC_PURGE_DELAY"] == "-1"
    assert host_heap_environ({**environ, "MIMALLOC_PURGE_DELAY": "100"})["MIMALLOC_PURGE_DELAY"] == "100"  # user's


def test_an_unknown_host_heap_is_one_line_and_exit_2():
    with pytest.raises(UserError, match="MARINCTL_HOST_HEAP='jemalloc'"):
        host_heap_environ({HOST_HEAP_OPT_OUT: "jemalloc"})
    environ = {**clean_environ(), HOST_HEAP_OPT_OUT: "jemalloc"}
    done = subprocess.run([sys.executable, "-c", ENTRY], env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "marinctl: MARINCTL_HOST_HEAP='jemalloc': expected one of mimalloc, hugepages, system"
    ]


RELEASE = """
import os, threading
import numpy as np
from marinctl.runtime import describe_host_heap, host_pages_held, host_pages_released

def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def churn():  # 256 MiB written, then freed
    a = np.ones(1 << 28, np.uint8)
    del a

base = rss()
churn()
kept = rss() - base
held = host_pages_held()
with host_pages_released():
    inside = host_pages_held()
    churn()
released = rss() - base
entered, leave = threading.Event(), threading.Event()

def compile_beside():  # the precompile thread inside a release while the main thread's eval ends
    with host_pages_released():
        entered.set()
        leave.wait()

thread = threading.Thread(target=compile_beside)
thread.start()
entered.wait()
with host_pages_released():
    pass
overlapped = host_pages_held()
leave.set()
thread.join()
print(held, inside, overlapped, host_pages_held(), kept >> 20, released >> 20)
print(describe_host_heap())
"""


@with_mimalloc
def test_released_host_pages_go_back_to_the_os_and_are_kept_again_after():
    done = subprocess.run(
        [sys.executable, "-c", RELEASE],
        env=host_heap_environ(clean_environ()),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    figures, described = done.stdout.splitlines()
    held, inside, overlapped, after, kept_mb, released_mb = figures.split()
    assert (held, inside, overlapped, after) == ("True", "False", "False", "True")  # kept again only when all left
    assert int(kept_mb) >= 200, done.stdout  # freed outside a release: still resident, ready for the next step
    assert int(released_mb) <= 32, done.stdout  # freed inside one: handed back
    assert described.startswith("mimalloc, freed pages kept while steps run"), described  # the run header's


def test_host_pages_released_is_a_no_op_on_glibc():
    done = subprocess.run(
        [sys.executable, "-c", RELEASE], env=clean_environ(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[:4] == ["None"] * 4  # glibc: nothing to keep or release
    assert int(done.stdout.split()[4]) <= 32  # it hands a large buffer back on free anyway
    with host_pages_released():
        assert host_pages_held() is None  # this pytest process runs on glibc
    assert describe_host_heap({"GLIBC_TUNABLES": HOST_HEAP_TUNABLE}) == "glibc malloc, transparent huge pages"
    assert describe_host_heap({}) == "the C library's malloc"
    own = {"LD_PRELOAD": "/opt/libmimalloc.so", "MIMALLOC_PURGE_DELAY": "100"}  # preloaded by the user, not us
    assert describe_host_heap(own) == "mimalloc, MIMALLOC_PURGE_DELAY=100"
