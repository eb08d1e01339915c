"""`marinctl export RUN_DIR --out DIR`: a checkpoint's weights as safetensors, with the config to use them.

Writes DIR/model.safetensors (one tensor per parameter-table path, layer-stacked, plus the QB
`router_bias`), DIR/config.json (architecture sections, RoPE convention, tensor names and axes) and
DIR/recipe.toml; the format is documented in `marinctl/export.py`. The directory appears whole or not
at all, and an existing one is replaced only with `--overwrite`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from marinctl.errors import UserError
from marinctl.stage import JsonOpt, QuietOpt, SetOpt, Stage, VerboseOpt, console, emit_json, open_recipe, setup_logging


def export(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `marinctl train`.", show_default=False)],
    out: Annotated[
        Path, typer.Option("--out", help="Directory to create (model.safetensors, config.json, recipe.toml).")
    ],
    step: Annotated[int | None, typer.Option("--step", help="Checkpoint step (default: the newest).")] = None,
    dtype: Annotated[
        str, typer.Option("--dtype", help="Parameter dtype: float32 (the master weights) or bfloat16.")
    ] = "float32",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out directory.")] = False,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Export a checkpoint's weights and router bias as safetensors + config.json + recipe.toml."""
    setup_logging(quiet, verbose)
    from marinctl.export import DTYPES, check_destination, write_export
    from marinctl.restore import restore_weights, run_recipe_path

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    recipe = open_recipe(run_recipe_path(run_dir), overrides)
    check_destination(out, overwrite)  # before reading gigabytes of checkpoint
    weights = restore_weights(recipe, run_dir, step)  # host numpy: export needs no devices
    summary = write_export(
        out, recipe, weights.step, weights.params, weights.router_bias, dtype=dtype, overwrite=overwrite
    )
    summary["run_dir"] = str(run_dir)
    if as_json:
        emit_json(summary)
    elif not quiet:
        console().print(
            f"exported step {summary['step']} of {run_dir} to {summary['out']}: {summary['tensors']} tensors, "
            f"{summary['bytes'] / 2**20:,.1f} MiB ({dtype})"
        )


stage = Stage(name="export", help="Export a checkpoint's weights as safetensors + config.json.", command=export)
