"""Training-step throughput of the model: tokens/s, achieved TFLOP/s and MFU against a measured peak.

    python bench/bench_model.py [recipes/tiny.toml] [--set section.key=value ...] [--steps 5] [--json]

Times a jitted forward + backward + plain SGD update on random tokens (one device). FLOPs follow SPEC 7
(`marinctl.counting.flops_per_token`, full-square attention, lm_head included, ×3 for training); the
peak is the trainer's MFU denominator (`marinctl.train.metrics.device_peak_flops`): on a CPU an f32 matmul
measured in the same process, so the MFU compares the model with what this machine delivers right now;
on a known GPU its datasheet bf16 peak.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from marinctl.counting import flops_per_token
from marinctl.model.loss import model_loss
from marinctl.model.transformer import init_model
from marinctl.recipe import load_recipe
from marinctl.train.metrics import device_peak_flops

REPO = Path(__file__).resolve().parents[1]


def random_batch(recipe, seed: int = 0) -> dict[str, jax.Array]:
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
    parser.add_argument("--steps", type=int, default=5, help="timed training steps (after one warm-up)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = parser.parse_args(argv)

    recipe = load_recipe(args.recipe, args.overrides)
    model = init_model(recipe, jax.random.key(recipe.train.seed))
    batch = random_batch(recipe)
    bias = jnp.zeros((recipe.model.num_layers, recipe.moe.num_experts))

    @eqx.filter_jit(donate="all")
    def train_step(model):
        loss_fn = lambda m: model_loss(m, batch, bias, recipe)  # noqa: E731
        (loss, _), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
        model = jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, model, grads)  # plain SGD
        return model, loss

    start = time.perf_counter()
    model, loss = train_step(model)
    jax.block_until_ready(loss)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        model, loss = train_step(model)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - start)

    step_s = float(np.median(times))
    tokens = recipe.tokens_per_step
    flops = flops_per_token(recipe)
    achieved = flops.train(tokens) / step_s
    achieved_causal = 3 * flops.per_token_causal * tokens / step_s
    # The trainer's MFU denominator, so bench and run report the same MFU: a measured f32 matmul on CPU,
    # the datasheet bf16 peak on a known GPU.
    peak, peak_source = device_peak_flops(jax.devices()[:1])
    result = {
        "recipe": recipe.name,
        "backend": jax.default_backend(),
        "devices": 1,
        "tokens_per_step": tokens,
        "compile_s": round(compile_s, 2),
        "step_s_median": round(step_s, 4),
        "step_s_min": round(min(times), 4),
        "tokens_per_s": round(tokens / step_s, 1),
        "model_tflops": round(achieved / 1e12, 5),
        "model_tflops_causal": round(achieved_causal / 1e12, 5),
        "matmul_peak_tflops": round(peak / 1e12, 5),
        "peak_source": peak_source,
        "mfu": round(achieved / peak, 4),
        "mfu_causal": round(achieved_causal / peak, 4),
        "loss": round(float(loss), 4),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{recipe.name}: {tokens} tokens/step on {jax.default_backend()}, compile {compile_s:.1f} s")
        print(
            f"  step {step_s * 1e3:.0f} ms (median of {args.steps}, min {min(times) * 1e3:.0f} ms)"
            f"  ->  {tokens / step_s:,.0f} tokens/s"
        )
        print(
            f"  model   {achieved / 1e12:8.4f} TFLOP/s (SPEC 7, full square)   {achieved_causal / 1e12:8.4f} (causal)"
        )
        print(f"  peak    {peak / 1e12:8.4f} TFLOP/s ({peak_source}; the trainer's MFU denominator)")
        print(
            f"  MFU     {achieved / peak:8.1%}                                 {achieved_causal / peak:8.1%} (causal)"
        )
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
