"""Export a checkpoint's weights: `model.safetensors` + `config.json` + `recipe.toml` in one directory.

Tensor naming: one safetensors tensor per parameter-table path (`marinctl.params.param_table`), named by
that dotted path exactly ('embed.weight', 'blocks.attention.w_q', 'blocks.moe.experts.w_up', ...).
Tensors under `blocks.` stay stacked over layers: their first axis is the layer index L (the scanned
block's layout), e.g. `blocks.moe.experts.w_up` is [L, E, l, I]. Matrices are stored [in, out]
(y = x @ W), not torch's [out, in]. `config.json` lists every tensor's shape and named axes.

Beside the parameters, the tensor `router_bias` [L, E] (always fp32) holds the QB bias of the
checkpoint's step: expert selection is `top_k(s + b)` (SPEC 2, LatentMoE step 1), so the model routes
differently without it. It is not a parameter (SPEC 3.5), hence its own name outside the table.

RoPE uses the split-halves convention of `marinctl/model/attention.py`: pairs (i, i + R/2) for
i < R/2 on the first R = int(head_dim · rope_fraction) dims of each head, local layers only when
`nope_global`. A converter to another format must keep that pairing.

The directory is written whole into a temporary sibling and renamed into place, so a reader never sees
a half-written export, and an existing export is replaced only with `overwrite`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from marinctl import __version__
from marinctl.errors import UserError
from marinctl.params import param_table
from marinctl.recipe import Recipe, load_recipe, recipe_to_dict, recipe_to_toml

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
RECIPE_FILE = "recipe.toml"
ROUTER_BIAS_TENSOR = "router_bias"
FORMAT, FORMAT_VERSION = "marinctl", 1
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class Exported:
    """An export read back: the recipe, {table path: array} and the router bias [L, E]."""

    recipe: Recipe
    params: dict[str, np.ndarray]
    router_bias: np.ndarray
    config: dict[str, Any]


def export_tensors(
    recipe: Recipe, params: Mapping[str, Any], router_bias: Any, dtype: str = "float32"
) -> dict[str, np.ndarray]:
    """{tensor name: host array}: every table path cast to `dtype`, plus the fp32 router bias."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    table = param_table(recipe)
    missing, extra = sorted(set(table) - set(params)), sorted(set(params) - set(table))
    if missing or extra:
        raise ValueError(f"parameters do not match the table: missing {missing[:3]}, unexpected {extra[:3]}")
    target = _numpy_dtype(dtype)
    tensors = {path: np.ascontiguousarray(np.asarray(params[path]).astype(target)) for path in table}
    tensors[ROUTER_BIAS_TENSOR] = np.ascontiguousarray(np.asarray(router_bias, dtype=np.float32))
    L, E = recipe.model.num_layers, recipe.moe.num_experts
    if tensors[ROUTER_BIAS_TENSOR].shape != (L, E):
        raise ValueError(f"router bias is {tensors[ROUTER_BIAS_TENSOR].shape}, the recipe needs {(L, E)}")
    return tensors


def export_config(recipe: Recipe, step: int, dtype: str) -> dict[str, Any]:
    """config.json: the architecture sections of the resolved recipe and what a loader must know."""
    sections = recipe_to_dict(recipe)
    a, m = recipe.attention, recipe.model
    rotary_dims = int(m.head_dim * a.rope_fraction)
    table = param_table(recipe)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "marinctl_version": __version__,
        "recipe": recipe.name,
        "step": step,
        "dtype": dtype,
        "model": sections["model"],
        "attention": sections["attention"],
        "moe": sections["moe"],
        "layer_is_global": list(recipe.layer_is_global()),
        "rope": {
            "convention": "split_halves",
            "pairs": "(i, i + rotary_dims/2) for i < rotary_dims/2 (GPT-NeoX / HF-Llama layout, not adjacent)",
            "rotary_dims": rotary_dims,
            "theta": a.rope_theta,
            "layers": "local only (global layers are NoPE)" if a.nope_global else "all",
        },
        "router_bias": {
            "tensor": ROUTER_BIAS_TENSOR,
            "shape": [m.num_layers, recipe.moe.num_experts],
            "dtype": "float32",
            "use": "selection only: top_k(router logits + bias); combine weights use the unbiased logits",
        },
        "tensor_naming": (
            "one tensor per parameter-table path; 'blocks.*' tensors are stacked with a leading layer axis; "
            "matrices are [in, out] (y = x @ W)"
        ),
        "tensors": {path: {"shape": list(spec.shape), "axes": list(spec.axes)} for path, spec in table.items()},
    }


def write_export(
    out: Path,
    recipe: Recipe,
    step: int,
    params: Mapping[str, Any],
    router_bias: Any,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write the export directory atomically; returns {out, step, dtype, tensors, bytes, files}."""
    import safetensors.numpy

    check_destination(out, overwrite)
    tensors = export_tensors(recipe, params, router_bias, dtype)
    config = export_config(recipe, step, dtype)
    out = out.absolute()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out {out}: cannot create {out.parent} ({err.strerror})") from None
    staging = _make_private_sibling(out, "tmp")
    try:
        metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "step": str(step), "dtype": dtype}
        safetensors.numpy.save_file(tensors, staging / WEIGHTS_FILE, metadata=metadata)
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        (staging / RECIPE_FILE).write_text(recipe_to_toml(recipe))
        _apply_umask(staging)
        _publish(staging, out, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {
        "out": str(out),
        "step": step,
        "dtype": dtype,
        "tensors": len(tensors),
        "bytes": (out / WEIGHTS_FILE).stat().st_size,
        "files": [WEIGHTS_FILE, CONFIG_FILE, RECIPE_FILE],
    }


def check_destination(out: Path, overwrite: bool) -> None:
    """Refuse before any work: an existing export is kept unless `overwrite`; a file is never replaced."""
    if out.exists() or out.is_symlink():
        if not out.is_dir():
            raise UserError(f"--out {out}: exists and is not a directory")
        if not overwrite:
            raise UserError(f"--out {out}: already exists; pass --overwrite to replace it")


def load_export(directory: Path) -> Exported:
    """Read an export back (the inverse of `write_export`): build the model with
    `marinctl.model.transformer.build_model(exported.recipe, exported.params)`."""
    import safetensors.numpy

    directory = Path(directory)
    for name in (WEIGHTS_FILE, CONFIG_FILE, RECIPE_FILE):
        if not (directory / name).is_file():
            raise UserError(f"{directory}: no {name}: not a marinctl export")
    config = json.loads((directory / CONFIG_FILE).read_text())
    if config.get("format") != FORMAT or config.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{directory / CONFIG_FILE}: not a marinctl export of format version {FORMAT_VERSION}")
    recipe = load_recipe(directory / RECIPE_FILE)
    tensors = safetensors.numpy.load_file(directory / WEIGHTS_FILE)
    router_bias = tensors.pop(ROUTER_BIAS_TENSOR)
    return Exported(recipe=recipe, params=tensors, router_bias=router_bias, config=config)


def _publish(staging: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished staging directory onto `out`. An existing `out` (only with overwrite) is
    first moved aside and deleted after the swap, so `out` always holds a complete export."""
    if not out.exists():
        os.rename(staging, out)  # fails if another writer created `out` meanwhile: nothing is lost
        return
    if not overwrite:  # appeared while we were writing
        raise UserError(f"--out {out}: already exists; pass --overwrite to replace it")
    retired = _make_private_sibling(out, "old")
    os.rename(out, retired / out.name)
    try:
        os.rename(staging, out)
    except BaseException:
        os.rename(retired / out.name, out)  # put the previous export back
        raise
    finally:
        shutil.rmtree(retired, ignore_errors=True)


def _make_private_sibling(out: Path, kind: str) -> Path:
    """A fresh hidden directory beside `out` (same filesystem, so the final rename is atomic)."""
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.{kind}-", dir=out.parent))


def _apply_umask(directory: Path) -> None:
    """mkdtemp (and safetensors) create owner-only entries; an export gets the permissions of any new file."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def _numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # numpy has no bfloat16; jax's own dependency provides it

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)
