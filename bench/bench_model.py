"""Training-step throughput of the model: tokens/s per MoE transport side by side, MFU against a measured peak.

    python bench/bench_model.py [recipes/tiny.toml] [--set section.key=value ...] [--steps 5]
        [--transports ragged,fixed,dense] [--mesh DATAxEXPERT | REPLICAxDATAxEXPERT] [--maxtext-shapes]
        [--no-eval] [--json]

Times a jitted forward + backward + plain SGD update on random tokens for each transport, the steps
interleaved so that every transport sees the same machine load, and a forward-only loss (the dropless
evaluation's work). Ratios are against the first of `fixed`, `pooled` present (the token-dropping step
the dropless one must keep up with). `--mesh 2x4` runs on a (replica 1, data 2, expert 4) mesh, on CPU
over simulated devices (`--xla_force_host_platform_device_count` is set before JAX starts);
`--maxtext-shapes` applies the shapes of the MaxText comparison (issue 10) before any `--set`.

FLOPs follow docs/recipe.md §7 (`marinctl.counting.flops_per_token`, full-square attention, lm_head included, ×3
for training); the peak is the trainer's MFU denominator (`marinctl.train.metrics.device_peak_flops`):
on a CPU an f32 matmul measured in the same process, on a known GPU its datasheet bf16 peak. With a mesh
of several simulated CPU devices sharing the cores, MFU is not meaningful and is not printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The MaxText comparison's shapes (issue 10; ../shared/bench/maxtext_cpu.sh): D 256, 4 layers, 2 heads × 128,
# 1 KV head, 16 experts top-2 width 128, seq 512, batch 8, vocab 256; latent, shared experts, gated
# norms, SConv, XSA, attention gate and quantile balancing off.
MAXTEXT_SHAPES = (
    "model.vocab_size=256",
    "model.hidden=256",
    "model.num_layers=4",
    "model.num_heads=2",
    "model.head_dim=128",
    "model.gated_norm=false",
    "model.sconv_sites=[]",
    "attention.local_kv_heads=1",
    "attention.global_kv_heads=1",
    "attention.xsa=false",
    "attention.gate=false",
    "moe.num_experts=16",
    "moe.top_k=2",
    "moe.expert_width=128",
    "moe.latent=false",
    "moe.shared_experts=0",
    "moe.balancing=none",
    "train.seq_len=512",
    "train.batch_size=8",
)


def parse_mesh(text: str | None) -> tuple[int, int, int] | None:
    if not text:
        return None
    try:
        sizes = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        sizes = ()
    if len(sizes) not in (2, 3) or min(sizes) < 1:
        raise SystemExit(f"--mesh {text!r}: expected DATAxEXPERT or REPLICAxDATAxEXPERT, e.g. 2x4")
    return (1, *sizes) if len(sizes) == 2 else sizes  # type: ignore[return-value]


def random_batch(recipe, seed: int = 0):
    import jax.numpy as jnp
    import numpy as np

    B, S, V = recipe.train.batch_size, recipe.train.seq_len, recipe.model.vocab_size
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(B, S + 1), dtype=np.int32)
    seg = np.ones((B, S), np.int32)
    seg[:, S // 2 :] = 2  # two packed documents per row: the masks are exercised as in training
    mask = np.ones((B, S), np.float32)
    mask[:, S // 2 - 1] = 0
    return {
        "tokens": jnp.asarray(tokens[:, :-1]),
        "targets": jnp.asarray(tokens[:, 1:]),
        "segment_ids": jnp.asarray(seg),
        "loss_mask": jnp.asarray(mask),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=str(REPO / "recipes" / "tiny.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value")
    parser.add_argument("--steps", type=int, default=5, help="timed training steps per transport (after a warm-up)")
    parser.add_argument("--transports", default="", help="comma list (default: the recipe's moe.transport)")
    parser.add_argument("--mesh", default="", help="DATAxEXPERT or REPLICAxDATAxEXPERT (default: one device)")
    parser.add_argument("--maxtext-shapes", action="store_true", help="the MaxText comparison's shapes")
    parser.add_argument("--no-eval", action="store_true", help="skip the forward-only (evaluation) timing")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)
    mesh_shape = parse_mesh(args.mesh)
    n_devices = math.prod(mesh_shape) if mesh_shape else 1
    if n_devices > 1 and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # Before JAX starts: on CPU, simulate the mesh's devices (ignored by GPU/TPU backends).
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n_devices}"
        )
    return run(args, mesh_shape)


def run(args, mesh_shape) -> dict:
    import contextlib
    import dataclasses

    import equinox as eqx
    import jax
    import numpy as np

    from marinctl.counting import flops_per_token
    from marinctl.model.loss import model_loss
    from marinctl.model.transformer import init_model
    from marinctl.recipe import load_recipe
    from marinctl.train.metrics import device_peak_flops

    overrides = [*(MAXTEXT_SHAPES if args.maxtext_shapes else ()), *args.overrides]
    base = load_recipe(args.recipe, overrides)
    names = [t.strip() for t in args.transports.split(",") if t.strip()] or [base.moe.transport]
    batch = random_batch(base)
    bias = jax.numpy.zeros((base.model.num_layers, base.moe.num_experts))
    mesh = None
    if mesh_shape:
        from marinctl.recipe import ParallelConfig
        from marinctl.routing.mesh import batch_sharding, make_mesh, param_shardings

        replica, data, expert = mesh_shape
        mesh = make_mesh(
            ParallelConfig(replica=replica, data=data, expert=expert), jax.devices()[: math.prod(mesh_shape)]
        )
        batch = jax.device_put(batch, batch_sharding(mesh))
    context = (lambda: jax.set_mesh(mesh)) if mesh is not None else contextlib.nullcontext

    steps, evals, compile_s = {}, {}, {}
    for name in names:
        recipe = base.replace(moe=dataclasses.replace(base.moe, transport=name))
        model = init_model(recipe, jax.random.key(recipe.train.seed))  # same seed: the same weights for all
        if mesh is not None:
            model = jax.device_put(model, param_shardings(model, recipe, mesh))

        def train_step(model, recipe=recipe):
            loss_fn = lambda m: model_loss(m, batch, bias, recipe)  # noqa: E731
            (loss, _), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
            model = jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, model, grads)  # plain SGD
            return model, loss

        def eval_loss(model, recipe=recipe):
            return model_loss(model, batch, bias, recipe)[0]

        start = time.perf_counter()
        with context():
            step_fn = eqx.filter_jit(train_step, donate="all")
            model, loss = step_fn(model)
            jax.block_until_ready(loss)
            eval_fn = None if args.no_eval else eqx.filter_jit(eval_loss)
            if eval_fn is not None:
                jax.block_until_ready(eval_fn(model))
        compile_s[name] = time.perf_counter() - start
        steps[name] = [step_fn, model, []]
        evals[name] = [eval_fn, []]

    # Interleave: one step of each transport in turn, so load changes hit them alike.
    for _ in range(args.steps):
        for name in names:
            step_fn, model, times = steps[name]
            with context():
                start = time.perf_counter()
                model, loss = step_fn(model)
                jax.block_until_ready(loss)
                times.append(time.perf_counter() - start)
                steps[name][1] = model
                eval_fn, eval_times = evals[name]
                if eval_fn is not None:
                    start = time.perf_counter()
                    jax.block_until_ready(eval_fn(model))
                    eval_times.append(time.perf_counter() - start)

    tokens = base.tokens_per_step
    flops = flops_per_token(base)
    peak, peak_source = (None, "") if mesh is not None else device_peak_flops(jax.devices()[:1])
    reference = next((n for n in ("fixed", "pooled") if n in names), names[0])
    results = {}
    for name in names:
        times, eval_times = steps[name][2], evals[name][1]
        step_s = float(np.median(times))
        eval_s = float(np.median(eval_times)) if eval_times else None
        achieved = flops.train(tokens) / step_s
        results[name] = {
            "compile_s": round(compile_s[name], 2),
            "step_s_median": round(step_s, 4),
            "step_s_min": round(min(times), 4),
            "tokens_per_s": round(tokens / step_s, 1),
            "eval_s_median": None if eval_s is None else round(eval_s, 4),
            "eval_tokens_per_s": None if eval_s is None else round(tokens / eval_s, 1),
            "model_tflops": round(achieved / 1e12, 5),
            "mfu": None if peak is None else round(achieved / peak, 4),
        }
    ref_step, ref_eval = results[reference]["step_s_median"], results[reference]["eval_s_median"]
    for r in results.values():
        r["step_vs_" + reference] = round(r["step_s_median"] / ref_step, 3)
        if ref_eval:
            r["eval_vs_" + reference] = round(r["eval_s_median"] / ref_eval, 3)
    summary = {
        "recipe": base.name,
        "backend": jax.default_backend(),
        "mesh": "x".join(map(str, mesh_shape)) if mesh_shape else "1 device",
        "tokens_per_step": tokens,
        "matmul_peak_tflops": None if peak is None else round(peak / 1e12, 5),
        "peak_source": peak_source,
        "reference": reference,
        "transports": results,
    }
    if args.json:
        print(json.dumps(summary))
        return summary
    print(
        f"{base.name}: {tokens} tokens/step on {jax.default_backend()}, {summary['mesh']}"
        f" (replica x data x expert), median of {args.steps} interleaved steps"
    )
    if peak is not None:
        print(f"  peak {peak / 1e12:.4f} TFLOP/s ({peak_source}; the trainer's MFU denominator)")
    header = f"  {'transport':10s} {'step ms':>9s} {'tokens/s':>9s} {'x ' + reference:>9s}"
    header += "" if peak is None else f" {'MFU':>6s}"
    header += "" if args.no_eval else f" {'eval ms':>9s} {'eval tok/s':>10s} {'x ' + reference:>9s}"
    print(header + f" {'compile s':>9s}")
    for name, r in results.items():
        line = (
            f"  {name:10s} {r['step_s_median'] * 1e3:9.0f} {r['tokens_per_s']:9,.0f} {r['step_vs_' + reference]:9.2f}"
        )
        line += "" if peak is None else f" {r['mfu']:6.1%}"
        if not args.no_eval:
            line += f" {r['eval_s_median'] * 1e3:9.0f} {r['eval_tokens_per_s']:10,.0f} {r['eval_vs_' + reference]:9.2f}"
        print(line + f" {r['compile_s']:9.1f}")
    return summary


if __name__ == "__main__":
    from marinctl.runtime import exec_with_host_heap

    exec_with_host_heap()  # the host heap the `marinctl` command runs with
    sys.exit(0 if main() else 1)
