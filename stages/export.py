"""`marinctl export RUN_DIR --out DIR [--format native|hf]`: a checkpoint's weights for other tools.

`native` (default) writes DIR/model.safetensors (one tensor per parameter-table path, layer-stacked,
`[in, out]`, plus the QB `router_bias`), DIR/config.json and DIR/recipe.toml (`marinctl/export.py`).
`hf` writes a Hugging Face–style directory: config.json with `auto_map`, per-layer `[out, in]` safetensors
(sharded past `--max-shard-size`), tokenizer files, generation_config.json and the PyTorch
`modeling_marin.py`, so `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` loads it
(`marinctl/hf/`); `marinctl import` reads it back. The directory appears whole or not at all, and an
existing one is replaced only with `--overwrite`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from marinctl.errors import UserError
from marinctl.stage import JsonOpt, QuietOpt, SetOpt, Stage, VerboseOpt, console, emit_json, open_recipe, setup_logging

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB', '500MiB', '1000000' -> bytes (decimal units like transformers' max_shard_size)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS or float(match.group(1)) <= 0:
        raise UserError(f"--max-shard-size {text!r}: give a size like 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[unit])


def export(
    run_dir: Annotated[Path, typer.Argument(help="A run directory written by `marinctl train`.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", help="Directory to create.")],
    fmt: Annotated[
        str, typer.Option("--format", help="native (marinctl's layer-stacked layout) or hf (Hugging Face style).")
    ] = "native",
    step: Annotated[int | None, typer.Option("--step", help="Checkpoint step (default: the newest).")] = None,
    dtype: Annotated[
        str, typer.Option("--dtype", help="Parameter dtype: float32 (the master weights) or bfloat16.")
    ] = "float32",
    max_shard_size: Annotated[
        str, typer.Option("--max-shard-size", help="hf: split model.safetensors into files of at most this size.")
    ] = "5GB",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing --out directory.")] = False,
    overrides: SetOpt = None,
    as_json: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> None:
    """Export a checkpoint's weights and router bias (native safetensors, or a Hugging Face–style directory)."""
    setup_logging(quiet, verbose)
    from marinctl.export import DTYPES, FORMATS, check_destination, checkpoint_recipe, write_export, write_hf_export
    from marinctl.restore import restore_weights, run_recipe_path

    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    shard_bytes = parse_size(max_shard_size)
    recipe = open_recipe(run_recipe_path(run_dir), overrides)
    check_destination(out, overwrite)  # before reading gigabytes of checkpoint
    if fmt == "hf":
        from marinctl.hf.tokenizer import check_tokenizer

        check_tokenizer(recipe)  # a missing tokenizer file is named before the checkpoint is read
    weights = restore_weights(recipe, run_dir, step)  # host numpy: export needs no devices
    recipe = checkpoint_recipe(recipe, run_dir, weights.step)  # the schedule's context and qk_mult at that step
    if fmt == "hf":
        summary = write_hf_export(
            out,
            recipe,
            weights.step,
            weights.params,
            weights.router_bias,
            dtype=dtype,
            overwrite=overwrite,
            max_shard_bytes=shard_bytes,
        )
    else:
        summary = write_export(
            out, recipe, weights.step, weights.params, weights.router_bias, dtype=dtype, overwrite=overwrite
        )
        summary["format"] = "native"
    summary["run_dir"] = str(run_dir)
    summary["skipped_checkpoints"] = list(weights.skipped)  # newer damaged ones, which and why (also logged)
    if as_json:
        emit_json(summary)
    elif not quiet:
        console().print(
            f"exported step {summary['step']} of {run_dir} to {summary['out']} ({fmt}): {summary['tensors']} tensors, "
            f"{summary['bytes'] / 2**20:,.1f} MiB ({dtype})"
        )


stage = Stage(
    name="export", help="Export a checkpoint's weights (native safetensors or Hugging Face style).", command=export
)
