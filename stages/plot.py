"""`marinctl plot RUN_DIR`: loss, eval macro loss, drop rate and parameter-norm PNGs from metrics.jsonl."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from marinctl.stage import JsonOpt, QuietOpt, Stage, console, emit_json


def plot(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (holds metrics.jsonl).", show_default=False)],
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Write loss.png, routing.png and norms.png into RUN_DIR (works while the run is still going)."""
    from marinctl.train.plots import write_plots

    written = write_plots(run_dir)
    if as_json:
        emit_json({"run_dir": str(run_dir), "plots": [str(p) for p in written]})
    elif not quiet:
        for path in written:
            console().print(f"wrote {path}")


stage = Stage(name="plot", help="Plot a run's metrics (loss, eval, drops, norms) as PNGs.", command=plot)
