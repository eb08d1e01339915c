"""Export a checkpoint's weights: `model.safetensors` + `config.json` + `recipe.toml` in one directory.

Tensor naming: one safetensors tensor per parameter-table path (`marinctl.params.param_table`), named by
that dotted path exactly ('embed.weight', 'blocks.attention.w_q', 'blocks.moe.experts.w_up', ...).
Tensors under `blocks.` stay stacked over layers: their first axis is the layer index L (the scanned
block's layout), e.g. `blocks.moe.experts.w_up` is [L, E, l, I]. Matrices are stored [in, out]
(y = x @ W), not torch's [out, in]. `config.json` lists every tensor's shape and named axes.

Beside the parameters, the tensor `router_bias` [L, E] (always fp32) holds the QB bias of the
checkpoint's step: expert selection is `top_k(s + b)` (docs/recipe.md §2.10 step 2), so the model routes
differently without it. It is not a parameter (docs/recipe.md §3.5), hence its own name outside the table.

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
    """Read an export back (the inverse of `write_export`). For inference build the model with
    `inference_model(exported.recipe, exported.params)`, never with the training transport: a dropping
    transport (fixed, pooled) silently changes the logits of whatever it drops."""
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


# --------------------------------------------------------------------------------------------------
# Inference from a checkpoint or an export: always dropless.


def inference_recipe(recipe: Recipe, tokens_per_call: int) -> Recipe:
    """`recipe` with a dropless transport for forwards of `tokens_per_call` tokens.

    Training transports (fixed, pooled) drop assignments past their capacity, which moves the logits of
    the dropped tokens (on a 160-token sequence of a 30-step tiny run the pooled transport dropped 41% of
    assignments). Inference computes every routed assignment (`dropless_transport`: `ragged` with an
    unbounded receive buffer, or `dense` where it is small and does at most twice the routed work). The two
    agree to float rounding (tests/routing).
    """
    import dataclasses

    from marinctl.train.evaluate import dropless_transport

    transport = dropless_transport(recipe, tokens_per_call)
    return recipe.replace(moe=dataclasses.replace(recipe.moe, transport=transport, ragged_buffer_factor=None))


def inference_model(recipe: Recipe, params: Mapping[str, Any], tokens_per_call: int = 4096):
    """(model, recipe): the Transformer assembled around `params` with `inference_recipe`'s transport."""
    from marinctl.model.transformer import build_model

    chosen = inference_recipe(recipe, tokens_per_call)
    return build_model(chosen, params), chosen


FORMATS = ("native", "hf")


def write_hf_export(
    out: Path,
    recipe: Recipe,
    step: int,
    params: Mapping[str, Any],
    router_bias: Any,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    max_shard_bytes: int | None = None,
) -> dict[str, Any]:
    """The Hugging Face–style directory (`marinctl.hf.export`), published atomically like `write_export`."""
    from marinctl.hf.export import DEFAULT_MAX_SHARD_BYTES, write_hf_files

    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    check_destination(out, overwrite)
    out = out.absolute()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out {out}: cannot create {out.parent} ({err.strerror})") from None
    staging = _make_private_sibling(out, "tmp")
    try:
        summary = write_hf_files(
            staging,
            recipe,
            step,
            params,
            router_bias,
            dtype=dtype,
            max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES,
        )
        _apply_umask(staging)
        _publish(staging, out, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return {"out": str(out), "step": step, "dtype": dtype, "format": "hf", **summary}


@dataclass(frozen=True)
class Weights:
    """Weights from any source marinctl reads: a run directory's checkpoint, a native or an HF export."""

    recipe: Recipe
    params: dict[str, Any]
    router_bias: Any
    step: int
    kind: str  # "run", "native", "hf"
    path: Path


def source_kind(path: Path) -> str:
    """ "hf", "native" or "run" for a directory; anything else is a one-line UserError."""
    from marinctl.hf.export import is_hf_export

    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such run or export directory")
    if not path.is_dir():
        raise UserError(f"{path}: not a directory (expected a run directory or an export)")
    if is_hf_export(path):
        return "hf"
    if (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file():
        return "native"
    if (path / RECIPE_FILE).is_file():
        return "run"
    raise UserError(f"{path}: neither a run directory (no {RECIPE_FILE}) nor an export (no {CONFIG_FILE})")


def open_weights(path: Path, step: int | None = None, overrides: tuple[str, ...] = ()) -> Weights:
    """Host-numpy weights and router bias of `path`, whichever kind it is (`--step` only for a run)."""
    from marinctl.hf.export import load_hf_export
    from marinctl.restore import restore_weights

    kind = source_kind(path)
    if kind != "run" and step is not None:
        raise UserError(f"--step {step}: {path} is an export (one step); --step applies to a run directory")
    if kind == "hf":
        hf = load_hf_export(path)
        return Weights(hf.recipe, hf.params, hf.router_bias, hf.step, kind, Path(path))
    if kind == "native":
        native = load_export(path)
        params = {k: np.asarray(v, np.float32) for k, v in native.params.items()}
        return Weights(native.recipe, params, native.router_bias, int(native.config.get("step", 0)), kind, Path(path))
    recipe = load_recipe(Path(path) / RECIPE_FILE, overrides)
    weights = restore_weights(recipe, Path(path), step)
    recipe = checkpoint_recipe(recipe, Path(path), weights.step)
    return Weights(recipe, weights.params, weights.router_bias, weights.step, kind, Path(path))


def checkpoint_recipe(recipe: Recipe, run_dir: Path, step: int) -> Recipe:
    """The recipe that describes a run's checkpoint at `step`: its schedule's changes up to then applied
    (context length, QK multiplier: `marinctl.schedule.eval_recipe`) and the changes list cleared. An export
    or an inference is the model as of that step; what the schedule would change later is no part of it."""
    import dataclasses

    from marinctl.schedule import eval_recipe, with_recorded

    current = eval_recipe(with_recorded(recipe, run_dir), step)
    return current.replace(schedule=dataclasses.replace(current.schedule, changes=()))
