"""A/B of XLA settings on the real train step, interleaved in one process.

    python bench/ab_step.py [recipes/tiny.toml] [--set section.key=value ...] [--steps 14] \\
        --variant no-ynn=xla_cpu_experimental_ynn_fusion_type: \\
        --variant sched=xla_cpu_enable_concurrency_optimized_scheduler:true

The recipe's step is compiled once as `base` (the recipe's `[runtime]` flags, as `marinctl train` runs it)
and once per `--variant NAME=OPTION:VALUE[,OPTION:VALUE...]` with those XLA debug options added to that
compile only. Enum values take the proto's names (`LIBRARY_FUSION_TYPE_REDUCE`); a repeated enum lists them
with commas (`OPTION:A,B`); an empty value clears it. Each variant trains its own copy of the state on the
same batches, one step of each in turn, so a machine whose speed drifts (these 2-core machines swing up to
2x within minutes) slows every variant alike, where separate processes run one after the other cannot tell
a 5% change from the drift. Prints the median step time, the ratio to `base`, how many cores were busy, and
the last loss (equal losses: the same computation).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

Options = dict[str, str | bool | int]


def parse_variant(text: str) -> tuple[str, Options]:
    """`name=opt:value,opt:value` -> (name, options). A comma-separated part without a colon continues the
    previous value (a repeated enum); `true`/`false` and integers are typed."""
    name, sep, spec = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--variant {text!r}: expected NAME=OPTION:VALUE[,OPTION:VALUE...]")
    items: list[str] = []
    for part in spec.split(",") if spec else []:
        if ":" not in part and items:
            items[-1] += "," + part
        else:
            items.append(part)
    options: Options = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or not key:
            raise SystemExit(f"--variant {text!r}: {item!r} is not OPTION:VALUE")
        options[key] = {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)
    return name, options


def build(recipe):
    """What `marinctl train` builds before it compiles its step: the built-in corpus if the recipe reads it, the
    loader, the mesh over every device, the batch sharding, the optimizer and the state's shardings."""
    import jax

    from marinctl.data.builtin import ensure_builtin_corpus
    from marinctl.data.loader import Loader
    from marinctl.routing.mesh import batch_sharding, make_mesh
    from marinctl.train.state import make_optimizer, state_shardings

    ensure_builtin_corpus(recipe)
    mesh = make_mesh(recipe.parallel, jax.devices())
    optimizer = make_optimizer(recipe)
    return Loader(recipe), mesh, batch_sharding(mesh), optimizer, state_shardings(recipe, optimizer, mesh)


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=str(REPO / "recipes" / "tiny.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value")
    parser.add_argument("--steps", type=int, default=14, help="timed steps per variant (after 2 warm-up steps)")
    parser.add_argument("--variant", dest="variants", action="append", default=[], help="NAME=OPTION:VALUE,...")
    parser.add_argument("--data-root", default=None, help="data.root for the built-in corpus (default: recipe's)")
    args = parser.parse_args(argv)
    variants = dict([("base", {}), *(parse_variant(v) for v in args.variants)])

    from marinctl.recipe import load_recipe
    from marinctl.runtime import apply_runtime

    overrides = list(args.overrides) + ([f"data.root={args.data_root}"] if args.data_root else [])
    recipe = load_recipe(args.recipe, overrides)
    apply_runtime(recipe.runtime)  # before JAX starts, as `marinctl train` does

    import jax
    import numpy as np

    from marinctl.train.state import init_state
    from marinctl.train.step import compile_train_step, device_batch

    loader, mesh, bsh, optimizer, shardings = build(recipe)
    rows = recipe.train.batch_size
    n_warm = 2
    with jax.set_mesh(mesh):
        steps, states = {}, {}
        for name, options in variants.items():
            t0 = time.perf_counter()
            steps[name] = compile_train_step(recipe, optimizer, shardings, bsh, options or None)
            states[name] = jax.jit(lambda: init_state(recipe, optimizer), out_shardings=shardings)()
            print(f"compiled {name} {options or '(recipe flags)'} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        batches = [device_batch(loader.host_batch(s, 0, 1), bsh, rows) for s in range(n_warm + args.steps)]
        walls: dict[str, list[float]] = {k: [] for k in steps}
        busy: dict[str, list[float]] = {k: [] for k in steps}
        loss: dict[str, float] = {}
        for i, batch in enumerate(batches):
            for name, step in steps.items():
                c0, t0 = time.process_time(), time.perf_counter()
                states[name], metrics = step(states[name], batch)
                loss[name] = float(jax.device_get(metrics["loss"]))
                wall = time.perf_counter() - t0
                if i >= n_warm:
                    walls[name].append(wall)
                    busy[name].append((time.process_time() - c0) / wall)

    base = float(np.median(walls["base"]))
    out = {}
    print(f"{recipe.name}: {recipe.tokens_per_step} tokens/step, median of {args.steps} interleaved steps")
    print("| variant | ms/step | tokens/s | vs base | cores busy | last loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in steps:
        wall = float(np.median(walls[name]))
        out[name] = {"wall_ms": wall * 1e3, "tokens_per_s": recipe.tokens_per_step / wall, "loss": loss[name]}
        print(
            f"| {name} | {wall * 1e3:.1f} | {recipe.tokens_per_step / wall:,.0f} | {base / wall:.3f}x | "
            f"{float(np.median(busy[name])):.2f} | {loss[name]:.6f} |"
        )
    return out


if __name__ == "__main__":
    from marinctl.runtime import exec_with_host_heap

    exec_with_host_heap()  # the host heap the `marinctl` command runs with
    main()
    sys.exit(0)
