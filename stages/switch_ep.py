"""`marinctl switch-ep RUN_DIR --transport T`: record a mid-run change of expert-parallel transport.

The hero switched from pooled to ragged all-to-all at 21% of its run (drops fell from ~3.4% to ~0.01%)
after an A/B from a checkpoint. This records the change in RUN_DIR/schedule.toml (atomically; the run's
recipe.toml is left as it was started) at `--at-step` (default: the run's newest checkpoint, where the
next `marinctl train` of the run resumes). The change is applied by that next `marinctl train RUN_DIR`
(or the original `marinctl train RECIPE --run-dir RUN_DIR`): a requeue, not the live process — recording
is refused while a trainer holds the run. Weights, optimizer state, QB bias, data position and LR schedule
pass through; the step is recompiled at the boundary (marinctl/schedule.py).

`--compare K` records nothing: it runs K steps from the newest checkpoint under the current and the
proposed transport (read-only restore, no metrics) and prints the side-by-side table.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer

from marinctl.errors import UserError
from marinctl.stage import JsonOpt, QuietOpt, Stage, VerboseOpt, console, emit_json, setup_logging

TRANSPORTS = ("dense", "fixed", "pooled", "ragged")
GiB = 2**30

RunDirArg = Annotated[Path, typer.Argument(help="A run directory written by `marinctl train`.", show_default=False)]
AtStepOpt = Annotated[
    int | None,
    typer.Option(
        "--at-step", help="First step of the change (default: the newest checkpoint, where a requeue resumes)."
    ),
]
CapacityOpt = Annotated[
    float | None, typer.Option("--capacity-factor", help="Also set moe.capacity_factor from that step.")
]


def switch_ep(
    run_dir: RunDirArg,
    transport: Annotated[
        str, typer.Option("--transport", help=f"The new transport ({'|'.join(TRANSPORTS)}).", show_default=False)
    ],
    capacity_factor: CapacityOpt = None,
    at_step: AtStepOpt = None,
    compare: Annotated[
        int | None,
        typer.Option(
            "--compare",
            help="Instead: run K steps from the newest checkpoint under both transports, "
            "write nothing, print the side-by-side table.",
        ),
    ] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Record a transport change in RUN_DIR/schedule.toml, applied by the run's next `marinctl train`."""
    setup_logging(quiet, verbose)
    if transport not in TRANSPORTS:
        raise UserError(f"--transport {transport!r}: choose one of {', '.join(TRANSPORTS)}")
    if capacity_factor is not None and capacity_factor <= 0:
        raise UserError(f"--capacity-factor {capacity_factor:g}: must be > 0")
    moe: dict[str, Any] = {"transport": transport}
    if capacity_factor is not None:
        moe["capacity_factor"] = capacity_factor
    if compare is not None:
        if compare < 1:
            raise UserError(f"--compare {compare}: run at least one step")
        if at_step is not None:
            raise UserError("--compare and --at-step: --compare always starts from the newest checkpoint")
        result = compare_transports(run_dir, moe, compare)
        if as_json:
            emit_json(result)
        elif not quiet:
            console().print(compare_table(result))
        return
    record_and_report(run_dir, {"moe": moe}, at_step, "switch-ep", as_json, quiet)


def record_and_report(run_dir: Path, table: dict[str, Any], at_step: int | None, what: str, as_json: bool,
                      quiet: bool) -> None:  # fmt: skip
    """Record one change under the run lock (a live trainer refuses it) and say what will happen."""
    from marinctl.restore import run_recipe_path
    from marinctl.runlock import RunLock
    from marinctl.schedule import record_change, schedule_path

    run_recipe_path(run_dir)  # not a run: one line, before anything is touched
    with RunLock(run_dir, f"marinctl {what}"):
        recorded, recipe = record_change(run_dir, table, at_step)
    if as_json:
        emit_json({"run_dir": str(run_dir), "file": str(schedule_path(run_dir)), "change": recorded})
    elif not quiet:
        console().print(
            f"recorded '{recorded['name']}' at step {recorded['at_step']} in {schedule_path(run_dir)}; "
            f"the next `marinctl train {run_dir}` applies it (steps {recorded['at_step']}–{recipe.train.steps - 1})"
        )


# --------------------------------------------------------------------------------------------------
# --compare K: the A/B the hero ran before switching


def compare_transports(run_dir: Path, moe: dict[str, Any], k: int) -> dict[str, Any]:
    """K steps from the newest checkpoint under the current and the proposed MoE settings; nothing written."""
    import dataclasses

    from marinctl.schedule import load_run_recipe, recipe_at, run_progress

    recipe = load_run_recipe(run_dir)
    start = run_progress(recipe, run_dir)
    from marinctl.restore import checkpoint_dir, checkpoint_steps

    if not checkpoint_steps(checkpoint_dir(recipe, run_dir)):
        raise UserError(f"{run_dir}: no checkpoint yet: --compare starts from one")
    current = recipe_at(recipe, start)
    proposed = current.replace(moe=dataclasses.replace(current.moe, **moe))
    k = min(k, recipe.train.steps - start)
    if k < 1:
        raise UserError(f"{run_dir}: the run is complete (step {start}); nothing to compare")

    from marinctl.train.loop import configure_jax

    configure_jax()
    import jax

    from marinctl.data.builtin import ensure_builtin_corpus
    from marinctl.data.loader import Loader
    from marinctl.routing.mesh import batch_sharding, make_mesh
    from marinctl.train.launch import check_batch_divides

    devices = jax.devices()
    check_batch_divides(current, len(devices), 1, first_seq_len=recipe.train.seq_len)
    mesh = make_mesh(recipe.parallel, devices)
    rows = batch_sharding(mesh)
    ensure_builtin_corpus(recipe)
    loader = Loader(recipe)
    shape = loader.shape(start)
    steps = [s for s in range(start, start + k) if loader.shape(s) == shape]  # stay inside one shape
    batches = [loader.batch(s) for s in steps]
    arms = {}
    with jax.set_mesh(mesh):
        for name, arm in (("current", current), ("proposed", proposed)):
            arms[name] = _run_arm(arm, recipe, run_dir, start, batches, mesh, rows)
    return {
        "run_dir": str(run_dir),
        "step": start,
        "steps": len(steps),
        "tokens_per_step": recipe.tokens_per_step,
        "current": {"transport": current.moe.transport, "capacity_factor": current.moe.capacity_factor,
                    **arms["current"]},
        "proposed": {"transport": proposed.moe.transport, "capacity_factor": proposed.moe.capacity_factor,
                     **arms["proposed"]},
    }  # fmt: skip


def _run_arm(arm, base, run_dir: Path, start: int, batches, mesh, rows) -> dict[str, float]:
    """Restore the full train state of checkpoint `start` read-only into `arm`'s structure and train."""
    import jax
    import numpy as np
    import orbax.checkpoint as ocp

    from marinctl.restore import _read_only_manager, checkpoint_dir
    from marinctl.train.checkpoint import STATE, flatten_state, unflatten_like
    from marinctl.train.state import abstract_state, make_optimizer, state_shardings, with_shardings
    from marinctl.train.step import compile_train_step, device_batch

    optimizer = make_optimizer(arm)
    shardings = state_shardings(arm, optimizer, mesh)
    abstract = with_shardings(abstract_state(arm, optimizer), shardings)
    flat_abstract = flatten_state(abstract)
    with _read_only_manager(checkpoint_dir(base, run_dir)) as manager:
        args = ocp.args.PyTreeRestore(
            item=flat_abstract,
            restore_args={key: ocp.ArrayRestoreArgs(sharding=leaf.sharding) for key, leaf in flat_abstract.items()},
        )
        flat = manager.restore(start, args=ocp.args.Composite(**{STATE: args}))[STATE]
    state = unflatten_like(abstract, flat)
    t0 = time.perf_counter()
    step_fn = compile_train_step(arm, optimizer, shardings, rows)
    compile_s = time.perf_counter() - t0
    memory = step_fn.memory_analysis()
    peak = None
    if memory is not None:
        peak = (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
                + memory.temp_size_in_bytes)  # fmt: skip
    times, losses, drops, senders, receivers = [], [], [], [], []
    for host in batches:
        batch = device_batch(host, rows, arm.train.batch_size)
        t = time.perf_counter()
        state, metrics = step_fn(state, batch)
        m = jax.device_get(metrics)
        times.append(time.perf_counter() - t)
        losses.append(float(m["loss"]))
        drops.append(float(m["drop_frac"]))
        senders.append(float(np.mean(m["sender_drop_frac_per_layer"])))
        receivers.append(float(np.mean(m["receiver_drop_frac_per_layer"])))
    steady = times[1:] or times  # the first call also pays for warm-up
    step_s = float(np.median(steady))
    return {
        "step_s": step_s,
        "tokens_per_s": base.tokens_per_step / step_s,
        "drop_frac": float(np.mean(drops)),
        "sender_drop_frac": float(np.mean(senders)),
        "receiver_drop_frac": float(np.mean(receivers)),
        "loss_mean": float(np.mean(losses)),
        "loss_last": losses[-1],
        "peak_bytes_per_device": peak,
        "compile_s": compile_s,
    }


def compare_table(result: dict[str, Any]):
    from rich.table import Table

    cur, new = result["current"], result["proposed"]
    table = Table(
        title=f"{result['steps']} steps from checkpoint {result['step']} of {result['run_dir']} (nothing written)",
        header_style="bold",
    )
    table.add_column("")
    table.add_column(f"current: {cur['transport']} (cf {cur['capacity_factor']:g})", justify="right")
    table.add_column(f"proposed: {new['transport']} (cf {new['capacity_factor']:g})", justify="right")
    table.add_column("proposed / current", justify="right")

    def row(label: str, key: str, fmt: str, ratio: bool = True) -> None:
        a, b = cur[key], new[key]
        if a is None or b is None:
            table.add_row(label, "-" if a is None else fmt.format(a), "-" if b is None else fmt.format(b), "")
            return
        table.add_row(label, fmt.format(a), fmt.format(b), f"{b / a:.3f}" if ratio and a else "")

    row("step time (s, median)", "step_s", "{:.4f}")
    row("tokens/s", "tokens_per_s", "{:,.0f}")
    row("sender drop fraction", "sender_drop_frac", "{:.4%}", ratio=False)
    row("receiver drop fraction", "receiver_drop_frac", "{:.4%}", ratio=False)
    row("drop fraction (all)", "drop_frac", "{:.4%}", ratio=False)
    row("loss (mean over the steps)", "loss_mean", "{:.4f}", ratio=False)
    row("loss (last step)", "loss_last", "{:.4f}", ratio=False)
    cur_peak, new_peak = cur["peak_bytes_per_device"], new["peak_bytes_per_device"]
    table.add_row(
        "peak memory / device (GiB, XLA)",
        "-" if cur_peak is None else f"{cur_peak / GiB:.4f}",
        "-" if new_peak is None else f"{new_peak / GiB:.4f}",
        f"{new_peak / cur_peak:.3f}" if cur_peak and new_peak else "",
    )
    return table


stage = Stage(
    name="switch-ep",
    help="Record a mid-run EP transport change in RUN_DIR/schedule.toml (recipe.toml untouched); the run's next "
    "`marinctl train` (a requeue) applies it, refused while a trainer holds the run. --compare K: A/B, no writes.",
    command=switch_ep,
)
