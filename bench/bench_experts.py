"""The dropless expert computation in isolation, and the f32 matmul rates of the step's shapes on this machine.

    python bench/bench_experts.py [--experts 16 --hidden 256 --width 128 --tokens 4096 --top-k 2] [--no-ragged-dot]

Part 1 times forward + backward (w.r.t. the rows and all three weights) of one MoE layer's SwiGLU experts
over `tokens · top_k` sorted assignment rows, laid out three ways:

- **tile loop**: the CPU `ragged` path today (`marinctl.routing.transports._tiled_swiglu`): a `fori_loop`
  over per-expert tiles of `_block_rows` rows, each tile a small matmul against its expert's matrices;
- **batched einsum at capacity C**: every expert's rows padded to a static C and one batched product
  (`_local_experts`, the `fixed` transport's layout); exact only while no expert holds more than C rows,
  so a dropless path built on it needs a few static C's chosen by the fullest expert (like the exchange's
  chunk sizes);
- **`jax.lax.ragged_dot`**: lowers on XLA:CPU to a product over every group (each row costs E rows).

Part 2 times single products of the shapes the step runs (experts, their backward, Newton-Schulz Grams),
so a layout's rate can be read against what the machine does for that shape.

Both parts run under marinctl's CPU XLA defaults (`marinctl.runtime`) unless `--default-flags`; set
`XLA_FLAGS` to try others. GFLOP/s count only the matmul FLOPs of the assigned rows (padding is overhead).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _time(fn: Callable, *args, repeats: int) -> float:
    """Best-of-`repeats` wall seconds of a jitted call, after one warm-up (compile) call."""
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=256, help="the rows' width (d, or the latent width)")
    parser.add_argument("--width", type=int, default=128, help="expert width I")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacities", default="1.125,1.25,1.5", help="C as multiples of the mean rows/expert")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--no-ragged-dot", action="store_true", help="skip ragged_dot (slow on CPU)")
    parser.add_argument("--default-flags", action="store_true", help="XLA's defaults, not marinctl's CPU flags")
    args = parser.parse_args(argv)

    if not args.default_flags:
        from marinctl.recipe import RuntimeConfig
        from marinctl.runtime import apply_runtime

        apply_runtime(RuntimeConfig())
    import os

    import jax
    import jax.numpy as jnp
    import numpy as np

    from marinctl.routing import transports as T
    from marinctl.train.metrics import measure_matmul_peak

    E, d, width = args.experts, args.hidden, args.width
    rows = args.tokens * args.top_k
    rng = np.random.default_rng(0)
    weights = tuple(
        jnp.asarray(rng.normal(size=shape) / np.sqrt(shape[1]), jnp.float32)
        for shape in ((E, d, width), (E, d, width), (E, width, d))
    )
    x = jnp.asarray(rng.normal(size=(rows, d)), jnp.float32)
    expert = jnp.asarray(np.sort(rng.integers(0, E, size=rows)), jnp.int32)  # uniform routing, sorted
    counts = jnp.bincount(expert, length=E).astype(jnp.int32)
    rank = T._rank_within_group(expert, E)
    flops = 3 * (3 * 2 * rows * d * width)  # three products, forward + two backward products each
    print(f"jax {jax.__version__}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    print(f"E {E}, rows {rows} ({rows / E:.0f}/expert, fullest {int(counts.max())}), d {d}, I {width}")

    def report(name: str, layer: Callable, repeats: int = args.repeats) -> None:
        loss = jax.jit(jax.value_and_grad(lambda *a: jnp.sum(layer(*a) ** 2), argnums=(0, 1, 2, 3)))
        seconds = _time(loss, x, *weights, repeats=repeats)
        print(f"  {name:34s} {seconds * 1e3:8.1f} ms  {flops / seconds / 1e9:6.1f} GFLOP/s", flush=True)

    print("\nfwd + bwd of one layer's experts:")
    block = T._block_rows(rows / E)
    n_tiles = T._max_tiles(rows, E, block)
    tile_group, used = T._tile_groups(counts, n_tiles, block)
    slot, source = T._tile_slots(expert, rank, counts, n_tiles, block)

    def tile_loop(x, wg, wu, wd):
        tiles = T._take(x, source, fill=rows).reshape(n_tiles, block, d)
        return T._take(T._tiled_swiglu(tiles, tile_group, used, wg, wu, wd).reshape(-1, d), slot)

    report(f"tile loop (block {block})", tile_loop)
    for factor in (float(f) for f in args.capacities.split(",")):
        cap = 8 * int(np.ceil(factor * rows / E / 8))
        if cap < int(counts.max()):
            print(f"  batched einsum C={cap:<5d}              skipped: the fullest expert has {int(counts.max())}")
            continue
        cell = expert * cap + rank
        src = T._inverse(cell, E * cap)

        def batched(x, wg, wu, wd, cap=cap, cell=cell, src=src):
            padded = T._take(x, src, fill=rows).reshape(E, cap, d)
            return T._take(T._local_experts(padded, wg, wu, wd).reshape(E * cap, d), cell)

        report(f"batched einsum C={cap} ({factor}x mean)", batched)
    if not args.no_ragged_dot:

        def ragged(x, wg, wu, wd):
            hidden = jax.nn.silu(jax.lax.ragged_dot(x, wg, counts)) * jax.lax.ragged_dot(x, wu, counts)
            return jax.lax.ragged_dot(hidden, wd, counts)

        report("jax.lax.ragged_dot", ragged, repeats=2)  # ~1 s a call on CPU

    print("\nsingle f32 products (best of the repeats):")
    e_mean = rows // E
    # (name, lhs shape, rhs shape or None for the lhs itself, einsum, contracted size)
    shapes: list[tuple[str, tuple[int, ...], tuple[int, ...] | None, str, int]] = [
        (f"all rows x one expert [{rows},{d}]@[{d},{width}]", (rows, d), (d, width), "ij,jk->ik", d),
        (f"down [{rows},{width}]@[{width},{d}]", (rows, width), (width, d), "ij,jk->ik", width),
        (f"weight grad [{rows},{d}]^T@[{rows},{width}]", (rows, d), (rows, width), "ji,jk->ik", rows),
        (f"batched {E}x[{e_mean},{d}]@[{d},{width}]", (E, e_mean, d), (E, d, width), "enl,eli->eni", d),
        ("Newton-Schulz Gram 64x[128,256]@T", (64, 128, 256), None, "bij,bkj->bik", 256),
    ]
    for name, a_shape, b_shape, spec, contraction in shapes:
        a = jnp.asarray(rng.normal(size=a_shape), jnp.float32)
        b = a if b_shape is None else jnp.asarray(rng.normal(size=b_shape), jnp.float32)
        product = jax.jit(lambda a, b, spec=spec: jnp.einsum(spec, a, b))
        out_shape = jax.eval_shape(product, a, b).shape
        n_flops = 2 * int(np.prod(out_shape)) * contraction
        seconds = _time(product, a, b, repeats=args.repeats)
        print(f"  {name:44s} {seconds * 1e3:7.2f} ms  {n_flops / seconds / 1e9:6.1f} GFLOP/s", flush=True)
    peak = measure_matmul_peak(jax.devices()[:1])  # the MFU denominator `marinctl train` uses
    print(f"  {'the trainer MFU peak (1024^2, faster of 2)':44s} {'':10s} {peak / 1e9:6.1f} GFLOP/s")


if __name__ == "__main__":
    from marinctl.runtime import exec_with_host_heap

    exec_with_host_heap()  # the host heap the `marinctl` command runs with
    main()
