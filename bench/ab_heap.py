"""Host heaps A/B'd on the real train step: one fresh process per heap per round, alternated.

    python bench/ab_heap.py [recipes/tiny.toml] [--set section.key=value ...] [--heaps hugepages,mimalloc]
        [--rounds 5] [--steps 40]

An allocator is chosen when a process starts (glibc reads its tunables, the loader LD_PRELOAD, only then), so
unlike `ab_step.py` the variants cannot share one process. Each round runs one child per `MARINCTL_HOST_HEAP`
value, in order; a child re-executes itself with that heap as `marinctl` does (`exec_with_host_heap`), compiles
the recipe's step, runs 3 warm-up steps and times `--steps` more, waiting for each step (no overlap with the
next batch), and reports its wall, CPU and minor page faults per step and its peak RSS. Alternating the children
round by round is what makes a 10% difference readable on machines whose speed drifts by more than that
within minutes: the table lists every pair, then the means and their ratio to the first heap.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(recipe_path: str, overrides: list[str], steps: int) -> dict[str, float]:
    """Time the recipe's compiled train step in this process (already re-executed with its heap)."""
    from marinctl.recipe import load_recipe
    from marinctl.runtime import apply_runtime

    recipe = load_recipe(recipe_path, overrides)
    apply_runtime(recipe.runtime)

    import jax
    from ab_step import build  # bench/ is this script's directory

    from marinctl.train.state import init_state
    from marinctl.train.step import compile_train_step, device_batch

    loader, mesh, bsh, optimizer, shardings = build(recipe)
    n_warm = 3
    with jax.set_mesh(mesh):
        step = compile_train_step(recipe, optimizer, shardings, bsh)
        state = jax.jit(lambda: init_state(recipe, optimizer), out_shardings=shardings)()
        rows = recipe.train.batch_size
        batches = [device_batch(loader.host_batch(s, 0, 1), bsh, rows) for s in range(n_warm + steps)]
        for batch in batches[:n_warm]:
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
        before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for batch in batches[n_warm:]:
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
        after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - t0
    return {
        "ms_per_step": 1e3 * wall / steps,
        "cpu_ms_per_step": 1e3 * (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / steps,
        "faults_per_step": (after.ru_minflt - before.ru_minflt) / steps,
        "peak_rss_gb": after.ru_maxrss / 1e6,  # KiB on Linux
        "tokens_per_step": recipe.tokens_per_step,
        "loss": float(jax.device_get(metrics["loss"])),
    }


def run_child(heap: str, args: argparse.Namespace) -> dict[str, float]:
    sys.path.insert(0, str(REPO))
    from marinctl.runtime import HOST_HEAP_ENV

    env = {k: v for k, v in os.environ.items() if k not in HOST_HEAP_ENV}  # only MARINCTL_HOST_HEAP decides
    env["MARINCTL_HOST_HEAP"] = heap
    cmd = [sys.executable, __file__, args.recipe, "--child", "--steps", str(args.steps)]
    cmd += [f"--set={o}" for o in args.overrides]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"ab_heap: the {heap} child failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, float]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=str(REPO / "recipes" / "tiny.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value")
    parser.add_argument("--heaps", default="hugepages,mimalloc", help="MARINCTL_HOST_HEAP values, comma-separated")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds (one child per heap each)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per child (after 3 warm-up steps)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.recipe, args.overrides, args.steps)))
        return {}

    heaps = [h for h in args.heaps.split(",") if h]
    results: dict[str, list[dict[str, float]]] = {h: [] for h in heaps}
    for r in range(args.rounds):
        for heap in heaps:
            results[heap].append(run_child(heap, args))
            print(f"round {r + 1}: {heap} {results[heap][-1]['ms_per_step']:.1f} ms/step", file=sys.stderr)

    first = heaps[0]
    mean = {h: statistics.fmean(x["ms_per_step"] for x in results[h]) for h in heaps}
    tokens = results[first][0]["tokens_per_step"]
    print(f"{Path(args.recipe).stem}: {tokens:.0f} tokens/step, {args.steps} timed steps per child")
    print("| round | " + " | ".join(f"{h} ms/step" for h in heaps) + " |")
    print("|---|" + "---:|" * len(heaps))
    for r in range(args.rounds):
        print(f"| {r + 1} | " + " | ".join(f"{results[h][r]['ms_per_step']:.1f}" for h in heaps) + " |")
    print()
    print("| heap | mean ms/step | vs " + first + " | CPU ms/step | faults/step | peak RSS GB | last loss |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for h in heaps:
        rows = results[h]
        cpu = statistics.fmean(x["cpu_ms_per_step"] for x in rows)
        faults = statistics.median(x["faults_per_step"] for x in rows)
        rss = max(x["peak_rss_gb"] for x in rows)
        print(
            f"| {h} | {mean[h]:.1f} | {mean[first] / mean[h]:.3f}x | {cpu:.0f} | {faults:,.0f} | {rss:.2f} | "
            f"{rows[-1]['loss']:.6f} |"
        )
    return results


if __name__ == "__main__":
    if "--child" in sys.argv:
        sys.path.insert(0, str(REPO))
        from marinctl.runtime import exec_with_host_heap

        exec_with_host_heap()  # the heap this child was started for, as the `marinctl` command applies it
    main()
