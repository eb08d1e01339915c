"""`marinctl eval-dropless RUN_DIR`: the design card's name for `marinctl eval RUN_DIR --dropless`.

Every routed assignment computed (dense, or ragged when dense would not fit), with the context the run's
schedule had at the checkpoint (`--seq-len` for another, e.g. the run's first after an extension).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from marinctl.stage import JsonOpt, QuietOpt, SetOpt, Stage, VerboseOpt


def eval_dropless(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `marinctl train`.", show_default=False)],
    step: Annotated[int | None, typer.Option("--step", help="Checkpoint step (default: the newest).")] = None,
    overrides: SetOpt = None,
    seq_len: Annotated[
        int | None, typer.Option("--seq-len", help="Context to evaluate at (default: the run's at that checkpoint).")
    ] = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Dropless evaluation of a checkpoint: per-source loss, bits per byte and the macro loss."""
    from stages.eval import evaluate_run

    evaluate_run(
        run_dir=run_dir,
        step=step,
        overrides=overrides,
        dropless=True,
        transport=None,
        seq_len=seq_len,
        as_json=as_json,
        quiet=quiet,
        verbose=verbose,
    )


stage = Stage(
    name="eval-dropless",
    help="Dropless eval of a run's checkpoint (= `marinctl eval --dropless`).",
    command=eval_dropless,
)
