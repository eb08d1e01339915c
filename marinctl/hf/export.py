"""Write and read a Hugging Face–style export directory.

    config.json                     transformers fields + architecture (marinctl/hf/config.py)
    model.safetensors               every tensor, or past `max_shard_bytes`:
    model-0000k-of-0000n.safetensors + model.safetensors.index.json
    tokenizer.json, tokenizer_config.json, special_tokens_map.json
    generation_config.json
    modeling_marin.py               the PyTorch forward pass (trust_remote_code)
    recipe.toml                     the resolved recipe: what `marinctl import` continues from

Every file is a deterministic function of (recipe, step, weights, dtype, shard size), so export → import →
export reproduces the directory byte for byte. Written into a private sibling and renamed into place
(`marinctl.export`'s publishing), so a reader never sees half an export.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from marinctl.errors import UserError
from marinctl.hf import mapping
from marinctl.hf.config import FORMAT, FORMAT_VERSION, MODEL_TYPE, MODELING_FILE, architecture_fields, hf_config
from marinctl.hf.config import generation_config as make_generation_config
from marinctl.hf.tokenizer import TOKENIZER_FILE, write_tokenizer_files
from marinctl.recipe import Recipe, load_recipe, recipe_to_toml

CONFIG_FILE = "config.json"
GENERATION_FILE = "generation_config.json"
RECIPE_FILE = "recipe.toml"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' own default shard size
SAFETENSORS_METADATA = {"format": "pt"}  # transformers refuses safetensors files without it


@dataclass(frozen=True)
class HFExported:
    """An HF export read back into marinctl's terms."""

    recipe: Recipe
    params: dict[str, np.ndarray]
    router_bias: np.ndarray
    step: int
    config: dict[str, Any]


def is_hf_export(directory: Path) -> bool:
    """A directory whose config.json says `model_type = "marin"`."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("model_type") == MODEL_TYPE
    except (ValueError, OSError):
        return False


def write_hf_files(
    staging: Path,
    recipe: Recipe,
    step: int,
    params: Mapping[str, Any],
    router_bias: Any,
    *,
    dtype: str = "float32",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> dict[str, Any]:
    """Fill the (empty, private) `staging` directory; returns {tensors, bytes, files}."""
    import safetensors.numpy

    from marinctl.export import _numpy_dtype

    target = _numpy_dtype(dtype)
    tensors = mapping.to_hf(recipe, params, router_bias)
    for name, value in tensors.items():
        if not name.endswith("mlp.router.bias"):  # the QB bias stays fp32 whatever the dtype
            tensors[name] = np.ascontiguousarray(value.astype(target))
    special = write_tokenizer_files(recipe, staging)
    shards = _shard(tensors, max_shard_bytes)
    files: list[str] = []
    if len(shards) == 1:
        safetensors.numpy.save_file(tensors, staging / SINGLE_FILE, metadata=SAFETENSORS_METADATA)
        files.append(SINGLE_FILE)
    else:
        weight_map = {}
        for k, names in enumerate(shards, start=1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            safetensors.numpy.save_file({n: tensors[n] for n in names}, staging / fname, metadata=SAFETENSORS_METADATA)
            weight_map.update(dict.fromkeys(names, fname))
            files.append(fname)
        total = sum(t.nbytes for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        files.append(INDEX_FILE)
    (staging / CONFIG_FILE).write_text(json.dumps(hf_config(recipe, step, dtype, special), indent=2) + "\n")
    generation = make_generation_config(recipe, special)
    (staging / GENERATION_FILE).write_text(json.dumps(generation, indent=2) + "\n")
    shutil.copyfile(Path(__file__).with_name(MODELING_FILE), staging / MODELING_FILE)
    (staging / RECIPE_FILE).write_text(recipe_to_toml(recipe))
    files += [CONFIG_FILE, GENERATION_FILE, TOKENIZER_FILE, MODELING_FILE, RECIPE_FILE]
    return {"tensors": len(tensors), "bytes": sum(t.nbytes for t in tensors.values()), "files": sorted(files)}


def load_hf_export(directory: Path) -> HFExported:
    """Read an HF export written by marinctl back (weights fp32 as stored, bias fp32). Anything else is a
    one-line UserError naming the file."""
    import safetensors.numpy

    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"{directory}: no such export directory")
    if not is_hf_export(directory):
        raise UserError(f"{directory}: no config.json with model_type {MODEL_TYPE!r}: not a marinctl hf export")
    config = json.loads((directory / CONFIG_FILE).read_text())
    info = config.get("marinctl") or {}
    if info.get("format") != FORMAT or info.get("format_version") != FORMAT_VERSION:
        raise UserError(f"{directory / CONFIG_FILE}: not a marinctl hf export of format version {FORMAT_VERSION}")
    if not (directory / RECIPE_FILE).is_file():
        raise UserError(f"{directory}: no {RECIPE_FILE}: not a marinctl hf export")
    recipe = load_recipe(directory / RECIPE_FILE)
    fields = architecture_fields(recipe)
    changed = [k for k, v in fields.items() if config.get(k) != v]
    if changed:
        raise UserError(
            f"{directory / CONFIG_FILE}: {changed[0]} = {config.get(changed[0])!r} disagrees with {RECIPE_FILE} "
            f"({fields[changed[0]]!r})"
        )
    if (directory / INDEX_FILE).is_file():
        index = json.loads((directory / INDEX_FILE).read_text())
        files = sorted(set(index.get("weight_map", {}).values()))
    elif (directory / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        raise UserError(f"{directory}: no {SINGLE_FILE} or {INDEX_FILE}")
    tensors: dict[str, np.ndarray] = {}
    for fname in files:
        if not (directory / fname).is_file():
            raise UserError(f"{directory}: {INDEX_FILE} names {fname}, which is missing")
        tensors.update(safetensors.numpy.load_file(directory / fname))
    try:
        params, bias = mapping.from_hf(recipe, tensors)
    except ValueError as err:
        raise UserError(f"{directory}: {err}") from None
    params = {k: v.astype(np.float32) for k, v in params.items()}
    return HFExported(recipe=recipe, params=params, router_bias=bias, step=int(info.get("step", 0)), config=config)


def _shard(tensors: Mapping[str, np.ndarray], max_bytes: int) -> list[list[str]]:
    """Consecutive tensors grouped into files of at most `max_bytes` (a larger tensor gets a file alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + t.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += t.nbytes
    return shards
