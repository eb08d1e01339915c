"""marinctl vs MaxText, side by side on this machine: training tokens/s at the same tiny dropless-MoE shapes.

    python bench/compare_maxtext.py MAXTEXT_VENV [--steps 20] [--warmup 5] [--rounds 1] [--transport ragged]

Both train for real, one after the other on the same machine, each with every core:

* **MaxText** 0.2.5 (its own virtualenv: Python 3.12, `pip install maxtext==0.2.5`, then its decoupled
  requirements file) runs `maxtext.trainers.pre_train.train` on synthetic data with its AdamW: f32, dropless MoE
  through `jax.lax.ragged_dot` (`sparse_matmul=True megablox=False capacity_factor=-1`), dot-product attention,
  `decoder_block=mixtral`: MaxText's default block (`llama2`) ignores `num_experts` and builds one dense MLP of
  width `base_mlp_dim` per layer (0.001 billion parameters at these shapes against the MoE's 0.007), which is
  what ../shared/bench/maxtext_cpu.sh trains (it sets no `decoder_block`) and this script trained until stop 37.
  `--maxtext-decoder-block llama2` runs that dense model again, for reference. The parameter count MaxText logs
  is printed beside marinctl's, and a count short of the routed experts' stops the script. Its per-step log
  lines ("completed step: N, seconds: ...") give the step times.
* **marinctl** runs `marinctl train bench/maxtext_shapes.toml` (built-in corpus, the hyperball optimizer, dropless
  `moe.transport`): the trainer's own `tokens_per_s` from `metrics.jsonl`.

Shapes: D 256, 4 layers, 2 heads x 128, 1 KV head, 16 experts top-2 width 128, seq 512, batch 8, vocab 264 (the
byte tokenizer's ids, padded; MaxText gets the same vocab), every layer full causal attention. Each figure is the
median over steps >= `--warmup` (compile and warm-up excluded). With `--rounds N` the two alternate N times and
the medians pool every round, which evens out a machine whose load changes.
MaxText is not a marinctl dependency: nothing here imports it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "bench" / "maxtext_shapes.toml"
STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([\d.]+).*?Tokens/s/device: ([\d.]+)")

SHAPES = {  # MaxText keys for the shapes of bench/maxtext_shapes.toml
    "base_emb_dim": 256,
    "base_num_query_heads": 2,
    "base_num_kv_heads": 1,
    "head_dim": 128,
    "base_num_decoder_layers": 4,
    "base_mlp_dim": 128,
    "base_moe_mlp_dim": 128,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "vocab_size": 264,
    "per_device_batch_size": 8,
    "max_target_length": 512,
}
MOE_BLOCK = "mixtral"  # MaxText's decoder block with routed experts (RoutedMoE); its default llama2 block is dense
PARAMS_LINE = re.compile(r"number parameters: ([\d.]+) billion")


def maxtext_command(venv: Path, out_dir: str, steps: int, decoder_block: str = MOE_BLOCK) -> list[str]:
    """The invocation of ../shared/bench/maxtext_cpu.sh (dropless ragged_dot MoE, f32, synthetic data) plus the
    `decoder_block` that script leaves out, without which MaxText builds no experts."""
    cfg = venv / "lib" / "python3.12" / "site-packages" / "maxtext" / "configs" / "decoupled_base_test.yml"
    if not cfg.is_file():
        found = sorted(venv.glob("lib/python3*/site-packages/maxtext/configs/decoupled_base_test.yml"))
        if not found:
            raise SystemExit(f"{venv}: no MaxText installation (maxtext/configs/decoupled_base_test.yml not found)")
        cfg = found[0]
    keys = {
        "run_name": "cpu_moe",
        "base_output_directory": out_dir,
        "hardware": "cpu",
        "skip_jax_distributed_system": "True",
        "dataset_type": "synthetic",
        "steps": steps,
        **SHAPES,
        "decoder_block": decoder_block,
        "sparse_matmul": "True",
        "megablox": "False",
        "capacity_factor": -1,
        "dtype": "float32",
        "weight_dtype": "float32",
        "attention": "dot_product",
        "enable_checkpointing": "False",
        "enable_goodput_recording": "False",
        "monitor_goodput": "False",
    }
    return [str(venv / "bin" / "python"), "-m", "maxtext.trainers.pre_train.train", str(cfg)] + [
        f"{k}={v}" for k, v in keys.items()
    ]


def run_maxtext(
    venv: Path, steps: int, warmup: int, runtime: dict[str, str] | None = None, decoder_block: str = MOE_BLOCK
) -> tuple[list[float], float | None]:
    """(tokens/s of each MaxText step >= warmup, the parameters MaxText logs in billions), with `runtime`'s
    environment variables (default none: MaxText's own XLA and malloc defaults)."""
    with tempfile.TemporaryDirectory(prefix="maxtext-") as out:
        env = {**os.environ, "DECOUPLE_GCLOUD": "TRUE", "JAX_PLATFORMS": "cpu"}
        env.pop("PYTHONPATH", None)  # marinctl's path must not leak into MaxText's interpreter
        env.pop("XLA_FLAGS", None)
        from marinctl.runtime import HOST_HEAP_ENV  # importable: main put the repository on the path

        for heap in HOST_HEAP_ENV:  # MaxText's own malloc unless `runtime` gives one
            env.pop(heap, None)
        env.update(runtime or {})
        cmd = maxtext_command(venv, out, steps, decoder_block)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    found = [(int(m[1]), float(m[2]), float(m[3])) for m in STEP_LINE.finditer(log)]
    if proc.returncode != 0 or not found:
        raise SystemExit(f"MaxText failed (exit {proc.returncode}), last output:\n{log[-3000:]}")
    params = PARAMS_LINE.search(log)
    return [tokens for step, _, tokens in found if step >= warmup], float(params[1]) if params else None


def check_builds_experts(logged_billions: float | None, routed: int) -> None:
    """Stop unless MaxText logged at least half of marinctl's routed-expert parameters: a model without its
    experts (a dense block, or a config key MaxText ignores) must not pass for the MoE. MaxText logs three
    decimals of a billion, so the bound is loose: the dense model's 0.001 fails, the MoE's 0.007 passes."""
    if logged_billions is None or logged_billions * 1e9 < 0.5 * routed:
        raise SystemExit(
            f"MaxText logged {logged_billions} billion parameters, fewer than marinctl's {routed:,} routed-expert "
            "parameters alone: it did not build the MoE"
        )


def run_marinctl(steps: int, warmup: int, transport: str, data_root: str | None, extra: list[str]) -> list[float]:
    """Tokens/s of each marinctl step >= warmup, from the trainer's metrics.jsonl."""
    with tempfile.TemporaryDirectory(prefix="marinctl-compare-") as run_dir:
        sets = [f"train.steps={steps}", f"moe.transport={transport}", *extra]
        if data_root:
            sets.append(f"data.root={data_root}")
        cmd = [sys.executable, "-m", "marinctl.cli", "train", str(RECIPE), "--run-dir", run_dir, "--quiet", "--json"]
        for item in sets:
            cmd += ["--set", item]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"marinctl train failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["tokens_per_s"] for r in records if r.get("kind") == "train" and r["step"] >= warmup]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("maxtext_venv", type=Path, help="virtualenv with maxtext==0.2.5 installed")
    parser.add_argument("--steps", type=int, default=20, help="training steps per run (each side)")
    parser.add_argument("--warmup", type=int, default=5, help="steps excluded from the medians")
    parser.add_argument("--rounds", type=int, default=1, help="alternate the two this many times")
    parser.add_argument("--transport", default="ragged", help="marinctl moe.transport (dropless: ragged, dense)")
    parser.add_argument("--data-root", default=None, help="marinctl data.root (built-in corpus built there if absent)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="extra marinctl overrides")
    parser.add_argument(
        "--maxtext-same-flags",
        action="store_true",
        help="also run MaxText under marinctl's CPU defaults (marinctl/runtime.py: XLA flags, and "
        "its host heap: huge-page malloc, or mimalloc under MARINCTL_HOST_HEAP=mimalloc) and report both",
    )
    parser.add_argument(
        "--maxtext-decoder-block",
        default=MOE_BLOCK,
        help=f"MaxText decoder_block (default {MOE_BLOCK}: the MoE; llama2, MaxText's default, is a dense model)",
    )
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")

    sys.path.insert(0, str(REPO))
    from marinctl.counting import count_params
    from marinctl.recipe import load_recipe
    from marinctl.runtime import CPU_DEFAULT_XLA_FLAGS, HOST_HEAP_OPT_OUT, host_heap_environ

    recipe = load_recipe(RECIPE, args.overrides)
    counts = count_params(recipe)
    routed = counts.components.get("routed experts", 0)
    ours: list[float] = []
    their_params: float | None = None
    runtimes: dict[str, dict[str, str]] = {"": {}}  # name -> the environment MaxText runs with
    if args.maxtext_same_flags:
        # The host heap marinctl re-executes itself with (MARINCTL_HOST_HEAP; default mimalloc where it installs).
        heap = host_heap_environ({HOST_HEAP_OPT_OUT: os.environ.get(HOST_HEAP_OPT_OUT, "")}) or {}
        heap.pop(HOST_HEAP_OPT_OUT, None)
        runtimes["marinctl's runtime"] = {"XLA_FLAGS": " ".join(CPU_DEFAULT_XLA_FLAGS), **heap}
    theirs: dict[str, list[float]] = {name: [] for name in runtimes}
    for r in range(args.rounds):
        t = time.perf_counter()
        ours += run_marinctl(args.steps, args.warmup, args.transport, args.data_root, args.overrides)
        print(f"round {r + 1}: marinctl done in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        for name, tokens in theirs.items():
            t = time.perf_counter()
            measured, their_params = run_maxtext(
                args.maxtext_venv, args.steps, args.warmup, runtimes[name], args.maxtext_decoder_block
            )
            tokens += measured
            print(f"round {r + 1}: MaxText {name or '(its defaults)'} done in {time.perf_counter() - t:.0f} s",
                  file=sys.stderr)  # fmt: skip
            if args.maxtext_decoder_block == MOE_BLOCK:
                check_builds_experts(their_params, routed)

    a = statistics.median(ours)
    print(f"shapes: {json.dumps(SHAPES)}; marinctl transport {args.transport}; medians over steps >= {args.warmup}")
    print(
        f"parameters: marinctl {counts.total:,} ({routed:,} in routed experts); MaxText {their_params} billion "
        f"(decoder_block={args.maxtext_decoder_block}, as it logs them)"
    )
    print(f"marinctl  {a:10,.0f} tokens/s  ({len(ours)} steps; hyperball optimizer, {args.transport} dropless)")
    for name, tokens in theirs.items():
        b = statistics.median(tokens)
        how = " ".join(f"{k}={v}" for k, v in runtimes[name].items()) or "its default XLA flags and malloc"
        model = "ragged_dot dropless MoE" if args.maxtext_decoder_block == MOE_BLOCK else "dense MLP, no experts"
        print(f"MaxText   {b:10,.0f} tokens/s  ({len(tokens)} steps; AdamW, {model}; {how})")
        print(f"ratio     {a / b:10.2f}x  (marinctl / MaxText)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
