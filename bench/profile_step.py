"""Where the training step's time goes: per-component device time of the real compiled train step.

    python bench/profile_step.py [recipes/tiny.toml] [--set section.key=value ...] [--steps 8] [--trace-steps 3]
                                 [--threads 1] [--top N]

Builds exactly what `marinctl train` runs (the recipe's `[runtime]` flags, mesh, sharded state, the hyperball
optimizer, the AOT-compiled donated step, the loader), then:

1. **Loop timing** (no profiler): `--steps` steps the way the trainer's loop runs them (next host batch,
   device_batch, step, fetch the previous step's metrics) -> wall per step, tokens/s and the trainer's MFU
   (docs/recipe.md §7 FLOPs against the same measured f32 matmul peak `marinctl train` logs).
2. **Device profile**: `--trace-steps` steps under `jax.profiler.trace`. XLA:CPU records one event per executed
   thunk (fusion, dot, copy, ...) named by its HLO instruction; the compiled module's metadata gives each
   instruction's Python stack, and the innermost marinctl/optax frame that a rule names decides the component
   (`RULES`; `FALLBACK_RULES` only when none does). Ops under `transpose(...)` in the JAX name stack are the
   backward pass. With more than one thread an event is not the whole op: a multi-threaded Eigen dot finishes
   on the pool after its thunk's event ends. `--threads 1` makes every recorded time exact (the loop timing
   and the peak are then one core's too); the table's "no op event open" row says how much a run left out.
3. **Data**: the loader's host batch built synchronously (`Loader.host_batch`), which the trainer's prefetch
   thread overlaps with the device step.

Host overhead = loop wall per step minus the device's busy span per step. The rows printed are exactly the
ones bench/README.md tabulates, so a re-run after a change fills its "after" column.
"""

from __future__ import annotations

import argparse
import glob
import json
import linecache
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# (file regex, function regex, source-line regex or None, component). For each op, the Python stack is walked
# from the innermost frame outward; the first frame that matches a rule names the component.
RULES: tuple[tuple[str, str, str | None, str], ...] = (
    (r"marinctl/model/attention\.py$", r"", None, "attention"),
    (r"marinctl/model/layers\.py$", r"ShortConv|sconv|short_conv", None, "SConv"),
    (r"marinctl/model/layers\.py$", r"RMSNorm|GatedNorm|rms_norm|normalize|norm", None, "norms"),
    (r"marinctl/model/moe\.py$", r"SharedExperts|shared", None, "shared experts"),
    (r"marinctl/model/moe\.py$", r"route|_beta|margin", None, "router + QB histogram"),
    (r"marinctl/model/moe\.py$", r"", r"router|route|logsumexp|lse|_beta|valid", "router + QB histogram"),
    (r"marinctl/model/moe\.py$", r"", r"latent", "latent projections"),
    (r"marinctl/model/moe\.py$", r"Experts|expert|swiglu|ffn", None, "experts"),
    (r"marinctl/routing/quantile_balance\.py$", r"", None, "router + QB histogram"),
    (r"marinctl/routing/transports\.py$", r"_local_experts|expert|ffn|swiglu|grouped", None, "experts"),
    (r"marinctl/routing/transports\.py$", r"", r"ragged_dot|einsum|silu|w_gate|w_up|w_down", "experts"),
    (r"marinctl/routing/", r"", None, "transport"),
    (r"marinctl/model/loss\.py$", r"", None, "lm_head + CE + z-loss"),
    (r"marinctl/model/transformer\.py$", r"", r"lm_head|logits", "lm_head + CE + z-loss"),
    (r"marinctl/model/transformer\.py$", r"", r"embed", "embedding"),
    (r"marinctl/model/transformer\.py$", r"document_positions", None, "other model (positions, scan)"),
    (r"marinctl/optim/muon\.py$", r"newton_schulz|iteration|orthogonal|_ns", None, "optimizer: Newton-Schulz"),
    (r"marinctl/optim/|/optax/", r"", None, "optimizer: momentum, Adam, hyperball"),
    (r"marinctl/train/step\.py$", r"gradient_norms|param_norms|norm", None, "metrics (grad/param norms)"),
    (r"marinctl/train/step\.py$", r"", None, "step: non-finite guard, QB bias, accumulation"),
)
# Tried only when no frame of the stack matches a rule above. As a rule of the walk it named the innermost
# model frame, so the forward products of every `layers.linear` (q/k/v/o, latent and shared-expert
# projections: `layers.py _linear_fwd`) were charged here instead of to the component that called them.
FALLBACK_RULES: tuple[tuple[str, str, str | None, str], ...] = (
    (r"marinctl/model/", r"", None, "other model (positions, scan)"),
)


def _compiled(rules: tuple[tuple[str, str, str | None, str], ...]) -> tuple:
    return tuple((re.compile(f), re.compile(fn), re.compile(ln) if ln else None, c) for f, fn, ln, c in rules)


_COMPILED_RULES, _COMPILED_FALLBACK = _compiled(RULES), _compiled(FALLBACK_RULES)
UNATTRIBUTED = "unattributed (copies, loop control)"
ORDER = (
    "attention",
    "SConv",
    "norms",
    "router + QB histogram",
    "transport",
    "experts",
    "latent projections",
    "shared experts",
    "embedding",
    "lm_head + CE + z-loss",
    "other model (positions, scan)",
    "optimizer: Newton-Schulz",
    "optimizer: momentum, Adam, hyperball",
    "metrics (grad/param norms)",
    "step: non-finite guard, QB bias, accumulation",
    UNATTRIBUTED,
)
CONTROL_OPCODES = {"while", "conditional", "call", "async-start", "async-done"}


# --------------------------------------------------------------------------------------------------
# The compiled module: instruction name -> (opcode, Python stack, backward?).


@dataclass(frozen=True)
class Instr:
    opcode: str
    frames: tuple[tuple[str, str, int], ...]  # (file, function, line), innermost first
    backward: bool
    op_name: str = ""


def parse_hlo(text: str) -> dict[str, Instr]:
    """Instruction table of an optimized HLO module's text (with its FileNames/StackFrames tables)."""
    tables: dict[str, dict[int, str]] = defaultdict(dict)
    section = None
    instrs: dict[str, Instr] = {}
    raw: list[tuple[str, str, int | None, str]] = []
    operands: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
            continue
        if section and re.match(r"^\d+ ", line):
            idx, rest = line.split(" ", 1)
            tables[section][int(idx)] = rest.strip().strip('"')
            continue
        section = None
        m = re.match(r"^\s*(?:ROOT )?%?([\w.\-]+) = \S+(?: \S+)*? ([a-z][\w\-]*)\(", line)
        if not m:
            continue
        name, opcode = m.group(1), m.group(2)
        frame = re.search(r"stack_frame_id=(\d+)", line)
        op_name = re.search(r'op_name="([^"]*)"', line)
        call = line[m.end() :].split(")", 1)[0]
        raw.append((name, opcode, int(frame.group(1)) if frame else None, op_name.group(1) if op_name else ""))
        operands[name] = re.findall(r"%([\w.\-]+)", call)

    locations = {}
    for idx, rest in tables["FileLocations"].items():
        f = re.search(r"file_name_id=(\d+) function_name_id=(\d+) line=(\d+)", rest)
        if f:
            locations[idx] = (
                tables["FileNames"].get(int(f.group(1)), "?"),
                tables["FunctionNames"].get(int(f.group(2)), "?"),
                int(f.group(3)),
            )
    parents, frame_loc = {}, {}
    for idx, rest in tables["StackFrames"].items():
        f = re.search(r"file_location_id=(\d+) parent_frame_id=(\d+)", rest)
        if f:
            frame_loc[idx] = int(f.group(1))
            parents[idx] = int(f.group(2)) - 1  # printed 1-based; 0 = no parent

    def stack(frame_id: int | None) -> tuple[tuple[str, str, int], ...]:
        out, seen = [], set()
        while frame_id and frame_id not in seen and frame_id in frame_loc:
            seen.add(frame_id)
            out.append(locations.get(frame_loc[frame_id], ("?", "?", 0)))
            frame_id = parents.get(frame_id, 0)
        return tuple(out)

    for name, opcode, frame_id, op_name in raw:
        instrs[name] = Instr(opcode, stack(frame_id), "transpose(" in op_name, op_name)

    def inherited(name: str, depth: int = 4) -> Instr | None:
        """The nearest operand (breadth-first, a few levels up) that has a Python stack."""
        level = operands.get(name, [])
        for _ in range(depth):
            for o in level:
                if o in instrs and instrs[o].frames and instrs[o].opcode not in ("parameter", "constant"):
                    return instrs[o]
            level = [p for o in level for p in operands.get(o, [])]
        return None

    # XLA's simplifier drops the metadata of some rewritten instructions (e.g. a dot whose size-1 head axis it
    # removed): such an instruction is charged to the component of the operand it computes from.
    for name, instr in list(instrs.items()):
        if not instr.frames and instr.opcode not in CONTROL_OPCODES and (src := inherited(name)) is not None:
            instrs[name] = Instr(instr.opcode, src.frames, src.backward, instr.op_name or src.op_name)
    return instrs


def component_of(instr: Instr | None) -> str:
    if instr is None:
        return UNATTRIBUTED
    for rules in (_COMPILED_RULES, _COMPILED_FALLBACK):
        for file, function, line in instr.frames:
            path = file.replace("\\", "/")
            for file_re, fn_re, line_re, component in rules:
                if not file_re.search(path) or not fn_re.search(function):
                    continue
                if line_re is not None and not line_re.search(linecache.getline(file, line)):
                    continue
                return component
    return UNATTRIBUTED


# --------------------------------------------------------------------------------------------------
# The trace: executed thunks of the step's module.


def device_events(trace_dir: str, module: str) -> list[tuple[str, int, float, float]]:
    """(hlo_op, run_id, start_ns, duration_ns) of every executed thunk of `module`."""
    from jax.profiler import ProfileData

    files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not files:
        raise RuntimeError(f"no profile written under {trace_dir}")
    out = []
    for plane in ProfileData.from_file(files[0]).planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if stats.get("hlo_module") != module or "hlo_op" not in stats:
                    continue
                out.append((str(stats["hlo_op"]), int(stats.get("run_id", 0)), event.start_ns, event.duration_ns))
    return out


def _is_control(instr: Instr | None) -> bool:
    return instr is not None and instr.opcode in CONTROL_OPCODES


def busy_union_ns(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, duration) intervals: the time at least one op event is open."""
    total, end = 0.0, float("-inf")
    for start, duration in sorted(intervals):
        stop = start + duration
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


# --------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipe", nargs="?", default=str(REPO / "recipes" / "tiny.toml"))
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value")
    parser.add_argument("--steps", type=int, default=8, help="loop-timed steps (after 2 warm-up steps)")
    parser.add_argument("--trace-steps", type=int, default=3, help="steps recorded by the profiler")
    parser.add_argument("--data-root", default=None, help="data.root for the built-in corpus (default: recipe's)")
    parser.add_argument("--top", type=int, default=0, help="also list the N costliest ops (where each comes from)")
    parser.add_argument("--hlo-out", default=None, help="write the compiled step's optimized HLO text here")
    parser.add_argument("--json", dest="json_out", default=None, help="also write the figures to this JSON file")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="XLA:CPU threads (PJRT_NPROC; default: every core). 1 makes every op's recorded time exact: with more, "
        "a multi-threaded dot finishes on Eigen's pool after its event ends, so dot-heavy components read low",
    )
    args = parser.parse_args(argv)
    if args.threads > 0:
        os.environ["PJRT_NPROC"] = str(args.threads)  # read when JAX creates its CPU client, below

    from marinctl.recipe import load_recipe
    from marinctl.runtime import apply_runtime

    overrides = list(args.overrides) + ([f"data.root={args.data_root}"] if args.data_root else [])
    recipe = load_recipe(args.recipe, overrides)
    apply_runtime(recipe.runtime)  # before JAX starts, as `marinctl train` does

    import jax
    import numpy as np

    import marinctl
    from marinctl.counting import flops_per_token
    from marinctl.data.builtin import ensure_builtin_corpus
    from marinctl.data.loader import Loader
    from marinctl.routing.mesh import batch_sharding, make_mesh
    from marinctl.train.loop import configure_jax
    from marinctl.train.metrics import device_peak_flops, throughput
    from marinctl.train.state import init_state, make_optimizer, state_shardings
    from marinctl.train.step import compile_train_step, device_batch

    print(f"marinctl from {Path(marinctl.__file__).parent}; jax {jax.__version__}; {recipe.name}", file=sys.stderr)
    configure_jax()  # the trainer's persistent compilation cache: a re-run skips the compile
    ensure_builtin_corpus(recipe)
    loader = Loader(recipe)
    devices = jax.devices()
    mesh = make_mesh(recipe.parallel, devices)
    bsh = batch_sharding(mesh)
    optimizer = make_optimizer(recipe)
    shardings = state_shardings(recipe, optimizer, mesh)
    rows = recipe.train.batch_size
    with jax.set_mesh(mesh):
        state = jax.jit(lambda: init_state(recipe, optimizer), out_shardings=shardings)()
        t0 = time.perf_counter()
        step_fn = compile_train_step(recipe, optimizer, shardings, bsh)
        compile_s = time.perf_counter() - t0
        hlo_text = step_fn.as_text()
        module = re.match(r"HloModule (\S+?),", hlo_text).group(1)
        instrs = parse_hlo(hlo_text)
        if args.hlo_out:
            Path(args.hlo_out).write_text(hlo_text)

        # Data: the host batch alone, synchronously.
        data_times = []
        for s in range(max(args.steps, 4)):
            t = time.perf_counter()
            loader.host_batch(s, 0, 1)
            data_times.append(time.perf_counter() - t)

        # Loop timing, as marinctl/train/loop.py runs the steps (prefetching iterator, metrics one step behind).
        n_warm = 2
        total = n_warm + args.steps + args.trace_steps
        batches = loader.iterate(0, total)
        pending, stamps = None, []
        for _ in range(n_warm + args.steps):
            host = next(batches)
            state, metrics = step_fn(state, device_batch(host, bsh, rows))
            if pending is not None:
                jax.device_get(pending)
            pending = metrics
            stamps.append(time.perf_counter())
        jax.device_get(pending)
        stamps.append(time.perf_counter())
        walls = np.diff(stamps)[n_warm:]  # step i's interval ends when step i-1's metrics are on the host
        wall_s = float(np.median(walls))

        if args.trace_steps <= 0:  # loop timing only (quick A/B runs)
            batches.close()
            flops = flops_per_token(recipe)
            peak, peak_source = device_peak_flops(devices)
            speed = throughput(recipe.tokens_per_step, wall_s, flops.per_token, len(devices), peak)
            print(
                f"{recipe.name}: wall {wall_s * 1e3:.1f} ms/step (median of {args.steps}: "
                f"{', '.join(f'{w * 1e3:.0f}' for w in walls)}), tokens/s {speed['tokens_per_s']:,.0f}, "
                f"MFU {speed['mfu']:.1%} (peak {peak / 1e12:.4f} TFLOP/s), compile {compile_s:.1f} s"
            )
            return {"wall_ms": wall_s * 1e3, **speed}
        trace_dir = tempfile.mkdtemp(prefix="marinctl-profile-")
        with jax.profiler.trace(trace_dir):
            for _ in range(args.trace_steps):
                host = next(batches)
                state, metrics = step_fn(state, device_batch(host, bsh, rows))
                jax.device_get(metrics)
        batches.close()

    events = device_events(trace_dir, module)
    runs = sorted({e[1] for e in events})
    if not runs:
        raise RuntimeError(f"the profile holds no events of {module}")
    spans = []
    per_component: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])  # [fwd ns, bwd ns] over all runs
    per_op: dict[str, float] = defaultdict(float)
    uncovered = []  # per run: time inside the span during which no op event is open
    for run in runs:
        mine = [e for e in events if e[1] == run and not _is_control(instrs.get(e[0]))]
        spans.append((max(e[2] + e[3] for e in mine) - min(e[2] for e in mine)) / 1e9)
        uncovered.append(spans[-1] - busy_union_ns([(e[2], e[3]) for e in mine]) / 1e9)
    for op, _, _, dur in events:
        instr = instrs.get(op)
        if _is_control(instr):
            continue  # a loop/call thunk spans its body's thunks, which are counted themselves
        per_component[component_of(instr)][1 if instr is not None and instr.backward else 0] += dur
        per_op[op] += dur
    n_runs = len(runs)
    op_ms = {c: (f / n_runs / 1e6, b / n_runs / 1e6) for c, (f, b) in per_component.items()}
    op_total_ms = sum(f + b for f, b in op_ms.values())
    span_s = float(np.median(spans))
    uncovered_s = float(np.median(uncovered))

    flops = flops_per_token(recipe)
    peak, peak_source = device_peak_flops(devices)
    speed = throughput(recipe.tokens_per_step, wall_s, flops.per_token, len(devices), peak)
    data_ms = float(np.median(data_times)) * 1e3

    rows_out: list[tuple[str, str, str, str, str]] = []
    for c in [*ORDER, *sorted(set(op_ms) - set(ORDER))]:
        if c not in op_ms:
            continue
        f, b = op_ms[c]
        rows_out.append((c, f"{f + b:.1f}", f"{100 * (f + b) / op_total_ms:.1f}%", f"{f:.1f}", f"{b:.1f}"))
    rows_out += [
        ("**device ops, sum**", f"{op_total_ms:.1f}", "100%", "", ""),
        ("device busy span per step", f"{span_s * 1e3:.1f}", "", "", ""),
        ("of the span, no op event open (async dot work)", f"{uncovered_s * 1e3:.1f}", "", "", ""),
        ("data loading (host batch; prefetched in training)", f"{data_ms:.1f}", "", "", ""),
        ("host overhead (loop wall - device span)", f"{(wall_s - span_s) * 1e3:.1f}", "", "", ""),
        ("**loop wall per step**", f"{wall_s * 1e3:.1f}", "", "", ""),
    ]
    print(
        f"\n{recipe.name}: {recipe.tokens_per_step} tokens/step, {len(devices)} device(s), "
        f"compile {compile_s:.1f} s; {n_runs} traced steps, {args.steps} loop-timed steps"
    )
    print("| component | ms/step | % of op time | fwd ms | bwd ms |")
    print("|---|---:|---:|---:|---:|")
    for r in rows_out:
        print("| " + " | ".join(r) + " |")
    print(
        f"\ntokens/s {speed['tokens_per_s']:,.0f}   MFU {speed['mfu']:.1%}   "
        f"(peak {peak / 1e12:.3f} TFLOP/s, {peak_source}; recipe §7 FLOPs {flops.per_token:.4g}/token)"
    )
    if uncovered_s > 0.05 * span_s:
        print(
            f"note: for {uncovered_s / span_s:.0%} of the span no op event is open. XLA:CPU's multi-threaded dots "
            "run on Eigen's pool after their event ends, so the rows above undercount dot-heavy components; "
            "--threads 1 times every op exactly (bench/README.md, stop 44)."
        )
    result = {
        "recipe": recipe.name,
        "marinctl": str(Path(marinctl.__file__).parent),
        "compile_s": compile_s,
        "components_ms": {c: {"fwd": f, "bwd": b} for c, (f, b) in op_ms.items()},
        "device_ops_ms": op_total_ms,
        "device_span_ms": span_s * 1e3,
        "uncovered_ms": uncovered_s * 1e3,
        "threads": os.environ.get("PJRT_NPROC", ""),
        "data_ms": data_ms,
        "host_overhead_ms": (wall_s - span_s) * 1e3,
        "wall_ms": wall_s * 1e3,
        "walls_ms": [w * 1e3 for w in walls],
        **speed,
        "peak_tflops": peak / 1e12,
    }
    if args.top:
        print(f"\ncostliest {args.top} ops (ms/step, component, opcode, innermost marinctl/optax frame):")
        for op, ns in sorted(per_op.items(), key=lambda kv: -kv[1])[: args.top]:
            instr = instrs.get(op)
            where = next(
                (f"{Path(f).name}:{ln} {fn}" for f, fn, ln in (instr.frames if instr else ()) if "marinctl" in f),
                instr.op_name[-60:] if instr else "-",
            )
            kind = f"{instr.opcode}{' bwd' if instr.backward else ''}" if instr else "?"
            print(f"  {ns / n_runs / 1e6:9.1f}  {component_of(instr):<28.28} {op:<28.28} {kind:<14} {where}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    try:  # huge-page malloc, as the `marinctl` command runs (a tree from before stop 38 has none)
        from marinctl.runtime import exec_with_host_heap
    except ImportError:
        pass
    else:
        exec_with_host_heap()
    main()
    sys.exit(0)
