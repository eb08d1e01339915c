"""`marinctl eval RUN_DIR`: the dropless evaluation of a run's checkpoint, outside the training loop.

The run dir's resolved recipe (plus `--set`) names the eval sources and batches; the checkpoint's model
and QB router bias are restored into the training layout and evaluated with the trainer's own eval
step (`marinctl.train.evaluate`), so the numbers equal the run's in-loop `eval` records at that step.
Dropless (the `dense` transport, or `ragged` when dense would not fit; docs/recipe.md §6) is the default;
`--transport fixed|pooled` evaluates with the drops a training transport makes, which measures
their cost against the dropless loss.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer

from marinctl.errors import UserError
from marinctl.stage import JsonOpt, QuietOpt, SetOpt, Stage, VerboseOpt, console, emit_json, setup_logging

TRANSPORTS = ("dense", "fixed", "pooled", "ragged")


def evaluate_run(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `marinctl train`.", show_default=False)],
    step: Annotated[int | None, typer.Option("--step", help="Checkpoint step (default: the newest).")] = None,
    overrides: SetOpt = None,
    dropless: Annotated[
        bool,
        typer.Option(
            "--dropless",
            help="Every routed assignment computed (ragged, or dense where it does little extra work). Default.",
        ),
    ] = False,
    transport: Annotated[
        str | None,
        typer.Option(
            "--transport", help=f"Evaluate with this MoE transport instead ({'|'.join(TRANSPORTS)}): the drop cost."
        ),
    ] = None,
    tasks: Annotated[
        str | None,
        typer.Option(
            "--tasks",
            help="lm-evaluation-harness tasks, comma-separated, instead of the loss sources "
            "(RUN_DIR may also be a native or hf export).",
        ),
    ] = None,
    include_path: Annotated[
        Path | None, typer.Option("--include-path", help="With --tasks: a directory of extra lm-eval task YAMLs.")
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="With --tasks: at most N documents per task.")] = None,
    batch_size: Annotated[
        int, typer.Option("--batch-size", help="With --tasks: rows per jitted forward (padded buckets).")
    ] = 8,
    seq_len: Annotated[
        int | None,
        typer.Option(
            "--seq-len",
            help="Context to evaluate at (default: the run's at that checkpoint; after an extension, the first "
            "context re-evaluates like the run's `macro_loss@S0` records).",
        ),
    ] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Evaluate a checkpoint: per-source loss and bits per byte, and the macro loss (dropless by default);
    with --tasks, lm-evaluation-harness tasks on the JAX model (docs/operations.md)."""
    setup_logging(quiet, verbose)
    if tasks is not None:
        from marinctl.lmeval import eval_tasks_command

        if transport is not None:
            raise UserError(f"--tasks and --transport {transport}: lm-eval tasks always run dropless")
        eval_tasks_command(
            run_dir, tasks, include_path, limit, step, batch_size, overrides, as_json, quiet, max_length=seq_len
        )
        return
    for flag, value in (("--include-path", include_path), ("--limit", limit)):
        if value is not None:
            raise UserError(f"{flag} applies only with --tasks")
    if transport is not None and transport not in TRANSPORTS:
        raise UserError(f"--transport {transport!r}: choose one of {', '.join(TRANSPORTS)}")
    if dropless and transport is not None:
        raise UserError(f"--dropless and --transport {transport}: choose one")
    from marinctl.schedule import load_run_recipe

    recipe = load_run_recipe(run_dir, overrides)  # + recorded changes; [runtime] applied before JAX starts
    if not recipe.eval.sources:
        raise UserError(f"{run_dir}: eval.sources is empty: name the sources to evaluate with --set eval.sources=...")
    result = run_eval(recipe, run_dir, step, transport, seq_len)
    if as_json:
        emit_json(result)
    elif not quiet:
        _print(result, recipe.eval.sources)


def run_eval(
    recipe, run_dir: Path, step: int | None, transport: str | None, seq_len: int | None = None
) -> dict[str, Any]:
    """{step, seq_len, transport, dropless, macro_loss, loss/<src>, bpb/<src>, tokens/<src>} for one checkpoint,
    with the recipe the run's schedule had in effect there (context, qk_mult), at `seq_len` when given."""
    from marinctl.train.loop import configure_jax

    configure_jax()
    import jax

    from marinctl.data.builtin import ensure_builtin_corpus
    from marinctl.data.loader import Loader
    from marinctl.model.transformer import build_model
    from marinctl.restore import restore_weights
    from marinctl.routing.mesh import batch_sharding, make_mesh, param_shardings
    from marinctl.train.evaluate import EvalStep, compile_eval_step, eval_transport, evaluate
    from marinctl.train.launch import check_eval_rows

    devices = jax.devices()
    check_eval_rows(recipe, len(devices))
    mesh = make_mesh(recipe.parallel, devices)
    rows = batch_sharding(mesh)
    ensure_builtin_corpus(recipe)  # as `marinctl train` does: the built-in eval stores are a rebuildable cache
    loader = Loader(recipe)  # missing eval data fails here, before the checkpoint is read
    weights = restore_weights(recipe, run_dir, step, mesh)
    from marinctl.schedule import eval_recipe

    first_seq_len = recipe.train.seq_len
    recipe = eval_recipe(recipe, weights.step, seq_len)
    check_eval_rows(recipe, len(devices), where=f"--seq-len {recipe.train.seq_len}", first_seq_len=first_seq_len)
    with jax.set_mesh(mesh):
        model = build_model(recipe, weights.params)
        shardings = param_shardings(model, recipe, mesh)
        if transport is None:  # exactly the trainer's in-loop eval step
            used = eval_transport(recipe, mesh.size)
            eval_step = compile_eval_step(recipe, shardings, rows)
        else:
            used = transport
            chosen = recipe.replace(moe=dataclasses.replace(recipe.moe, transport=transport))
            eval_step = EvalStep(chosen, shardings, rows)
        sums = evaluate(eval_step, model, weights.router_bias, loader, recipe, rows)
    return {
        "run_dir": str(run_dir),
        "step": weights.step,
        "seq_len": recipe.train.seq_len,
        "transport": used,
        # the default step clears ragged's receive-buffer bound (`dropless_recipe`); a named `ragged` drops
        # only when the recipe bounds it (moe.ragged_buffer_factor)
        "dropless": transport is None
        or used == "dense"
        or (used == "ragged" and recipe.moe.ragged_buffer_factor is None),
        "macro_loss": sums["macro_loss"],
        **{k: v for k, v in sums.items() if k != "macro_loss"},
        "skipped_checkpoints": list(weights.skipped),  # newer damaged ones, which and why (also logged)
    }


def _print(result: dict[str, Any], sources: tuple[str, ...]) -> None:
    from marinctl.train.display import eval_table

    table = eval_table(None, result, sources)
    kind = "dropless" if result["dropless"] else "with drops"
    table.title = f"eval at step {result['step']} ({kind}, {result['transport']} transport)"
    console().print(table)


stage = Stage(
    name="eval",
    help="Evaluate a run's checkpoint (dropless by default): per-source loss, bits/byte, macro.",
    command=evaluate_run,
)
