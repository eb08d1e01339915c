"""`marinctl extend-context RUN_DIR --seq-len S`: record a mid-run context extension.

The hero went 4k → 16k → 65k with tokens per step held at 46.1M (fewer, longer sequences), raising the QK
multiplier to qk_mult·(1 + 0.1·ln(S/S0)) (docs/recipe.md §8; `--qk-mult auto`, the default) and, at 65k,
the capacity factor. Like `switch-ep`, this records the change in RUN_DIR/schedule.toml (atomically; the
run's recipe.toml is untouched) at `--at-step` (default: the newest checkpoint) and the next
`marinctl train` of the run applies it: the batch is re-derived (a sequence length that does not divide
the tokens per step, or leaves fewer sequences than the mesh holds, is refused), the step recompiled, and
the batch at every step stays a pure function of (seed, step, schedule), so resumes stay exact.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from marinctl.errors import UserError
from marinctl.stage import JsonOpt, QuietOpt, Stage, VerboseOpt, setup_logging
from stages.switch_ep import AtStepOpt, CapacityOpt, RunDirArg, record_and_report


def extend_context(
    run_dir: RunDirArg,
    seq_len: Annotated[int, typer.Option("--seq-len", help="The new sequence length S.", show_default=False)],
    qk_mult: Annotated[
        str, typer.Option("--qk-mult", help="'auto' (qk_mult·(1 + 0.1·ln(S/S0))) or a number.")
    ] = "auto",
    capacity_factor: CapacityOpt = None,
    at_step: AtStepOpt = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Record a context extension in RUN_DIR/schedule.toml, applied by the run's next `marinctl train`."""
    setup_logging(quiet, verbose)
    if seq_len < 2:
        raise UserError(f"--seq-len {seq_len}: must be ≥ 2")
    mult: str | float = qk_mult
    if qk_mult != "auto":
        try:
            mult = float(qk_mult)
        except ValueError:
            raise UserError(f"--qk-mult {qk_mult!r}: expected 'auto' or a number") from None
        if not mult > 0:
            raise UserError(f"--qk-mult {qk_mult}: must be > 0")
    if capacity_factor is not None and capacity_factor <= 0:
        raise UserError(f"--capacity-factor {capacity_factor:g}: must be > 0")
    table: dict[str, Any] = {"train": {"seq_len": seq_len}, "attention": {"qk_mult": mult}}
    if capacity_factor is not None:
        table["moe"] = {"capacity_factor": capacity_factor}
    record_and_report(run_dir, table, at_step, "extend-context", as_json, quiet)


stage = Stage(
    name="extend-context",
    help="Record a mid-run context extension (tokens per step kept, qk_mult auto) in RUN_DIR/schedule.toml; the "
    "run's next `marinctl train` (a requeue) applies it, refused while a trainer holds the run.",
    command=extend_context,
)
