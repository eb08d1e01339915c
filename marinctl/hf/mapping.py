"""Tensor names and layouts between marinctl's parameter table and the Hugging Face–style export.

marinctl stores blocks layer-stacked (`[L, ...]`, one scanned block) with matrices `[in, out]` (y = x @ W);
the export stores one tensor per layer, matrices `[out, in]` like `torch.nn.Linear`, shared experts one
module each, and SConv taps as `[channels, K]` (tap j = lag j, lag 0 the current token). The QB router
bias of the checkpoint's step travels as `model.layers.{i}.mlp.router.bias` (selection only).

The mapping is a pure relabelling plus transposes: `to_hf` followed by `from_hf` returns the same bytes,
which is what makes export → import → export byte-identical.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from marinctl.params import ParamSpec, param_table
from marinctl.recipe import Recipe

LAYER = "model.layers.{i}."
ROUTER_BIAS = LAYER + "mlp.router.bias"

# marinctl table path -> export name ({i}: layer, {s}: shared expert).
NAMES: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "embed_norm.gain": "model.embed_norm.weight",
    "embed_gated_norm.w_down": "model.embed_gated_norm.down_proj.weight",
    "embed_gated_norm.w_up": "model.embed_gated_norm.up_proj.weight",
    "blocks.attn_norm.gain": LAYER + "input_norm.weight",
    "blocks.attn_gated_norm.w_down": LAYER + "input_gated_norm.down_proj.weight",
    "blocks.attn_gated_norm.w_up": LAYER + "input_gated_norm.up_proj.weight",
    "blocks.attention.w_q": LAYER + "self_attn.q_proj.weight",
    "blocks.attention.w_k": LAYER + "self_attn.k_proj.weight",
    "blocks.attention.w_v": LAYER + "self_attn.v_proj.weight",
    "blocks.attention.w_o": LAYER + "self_attn.o_proj.weight",
    "blocks.attention.w_gate": LAYER + "self_attn.gate_proj.weight",
    "blocks.attention.qk_mult": LAYER + "self_attn.qk_mult",
    "blocks.sconv_keys.weight": LAYER + "self_attn.k_conv.weight",
    "blocks.sconv_values.weight": LAYER + "self_attn.v_conv.weight",
    "blocks.sconv_attn_out.weight": LAYER + "attn_out_conv.weight",
    "blocks.mlp_norm.gain": LAYER + "post_attention_norm.weight",
    "blocks.mlp_gated_norm.w_down": LAYER + "post_attention_gated_norm.down_proj.weight",
    "blocks.mlp_gated_norm.w_up": LAYER + "post_attention_gated_norm.up_proj.weight",
    "blocks.moe.router": LAYER + "mlp.router.weight",
    "blocks.moe.latent_down": LAYER + "mlp.latent_down_proj.weight",
    "blocks.moe.latent_norm.gain": LAYER + "mlp.latent_norm.weight",
    "blocks.moe.latent_up": LAYER + "mlp.latent_up_proj.weight",
    "blocks.moe.experts.w_gate": LAYER + "mlp.experts.gate_proj.weight",
    "blocks.moe.experts.w_up": LAYER + "mlp.experts.up_proj.weight",
    "blocks.moe.experts.w_down": LAYER + "mlp.experts.down_proj.weight",
    "blocks.moe.shared.w_gate": LAYER + "mlp.shared_experts.{s}.gate_proj.weight",
    "blocks.moe.shared.w_up": LAYER + "mlp.shared_experts.{s}.up_proj.weight",
    "blocks.moe.shared.w_down": LAYER + "mlp.shared_experts.{s}.down_proj.weight",
    "blocks.sconv_mlp_out.weight": LAYER + "mlp_out_conv.weight",
    "final_norm.gain": "model.final_norm.weight",
    "final_gated_norm.w_down": "model.final_gated_norm.down_proj.weight",
    "final_gated_norm.w_up": "model.final_gated_norm.up_proj.weight",
    "lm_head.weight": "lm_head.weight",
}

# Leaves stored as given (vectors, and the embedding, which is already [vocab, hidden] like nn.Embedding).
_AS_IS = {"embed.weight"}


def _transposed(path: str, spec: ParamSpec) -> bool:
    """Matrices (and the [K, C] conv taps) swap their last two axes; per-layer vectors stay."""
    per_layer = len(spec.shape) - sum(ax in ("layers", "shared") for ax in spec.axes)
    return path not in _AS_IS and per_layer >= 2


def to_hf(recipe: Recipe, params: Mapping[str, Any], router_bias: Any) -> dict[str, np.ndarray]:
    """{export name: array}: the embedding side, then layer by layer, then the final norm and head (the
    order a person reads them in, and the order the shards fill); the router bias is fp32."""
    bias = np.asarray(router_bias, dtype=np.float32)
    views = to_hf_views(recipe, {path: np.asarray(v) for path, v in params.items()}, bias)
    return {name: _contiguous(views[name]) for name in _ordered(views, recipe.model.num_layers)}


def _ordered(names: Mapping[str, Any], num_layers: int) -> list[str]:
    top = [k for k in names if not k.startswith("model.layers.")]
    head = [k for k in top if not k.startswith(("model.final", "lm_head"))]
    layers = [[k for k in names if k.startswith(f"model.layers.{i}.")] for i in range(num_layers)]
    return head + [k for layer in layers for k in layer] + [k for k in top if k not in head]


def from_hf(recipe: Recipe, tensors: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(params by table path, router bias [L, E] fp32) from export tensors; names every missing or
    unexpected tensor and every shape mismatch (ValueError)."""
    table = param_table(recipe)
    L = recipe.model.num_layers
    expected = expected_shapes(recipe)
    missing = [k for k in expected if k not in tensors]
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        what = f"missing {missing[0]!r}" if missing else f"unexpected {extra[0]!r}"
        raise ValueError(f"tensors do not match the config: {what} ({len(missing)} missing, {len(extra)} unexpected)")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"tensor {name!r} is {list(tensors[name].shape)}, the config needs {list(shape)}")
    params: dict[str, np.ndarray] = {}
    for path, spec in table.items():
        name = _name(path)
        transpose = _transposed(path, spec)

        def back(a: np.ndarray, transpose: bool = transpose) -> np.ndarray:
            return a.swapaxes(-1, -2) if transpose else a

        if spec.axes[0] != "layers":
            params[path] = _contiguous(back(tensors[name]))
        elif "shared" in spec.axes:
            n = spec.shape[spec.axes.index("shared")]
            params[path] = _contiguous(
                np.stack([np.stack([back(tensors[name.format(i=i, s=s)]) for s in range(n)]) for i in range(L)])
            )
        else:
            params[path] = _contiguous(np.stack([back(tensors[name.format(i=i)]) for i in range(L)]))
    bias = np.stack([np.asarray(tensors[ROUTER_BIAS.format(i=i)], dtype=np.float32) for i in range(L)])
    return params, bias


def expected_shapes(recipe: Recipe) -> dict[str, tuple[int, ...]]:
    """{export name: shape} for this recipe, in `to_hf`'s order."""
    table = param_table(recipe)
    fake = {path: np.broadcast_to(np.zeros((), np.float32), spec.shape) for path, spec in table.items()}
    L, E = recipe.model.num_layers, recipe.moe.num_experts
    bias = np.broadcast_to(np.zeros((), np.float32), (L, E))
    views = to_hf_views(recipe, fake, bias)
    return {name: tuple(views[name].shape) for name in _ordered(views, L)}


def to_hf_views(recipe: Recipe, params: Mapping[str, Any], router_bias: Any) -> dict[str, np.ndarray]:
    """`to_hf` without copies, for shapes only."""
    table = param_table(recipe)
    L = recipe.model.num_layers
    names: dict[str, np.ndarray] = {}
    for path, spec in table.items():
        name, value, transpose = _name(path), params[path], _transposed(path, spec)
        if spec.axes[0] != "layers":
            names[name] = value.swapaxes(-1, -2) if transpose else value
            continue
        for i in range(L):
            if "shared" in spec.axes:
                for s in range(value.shape[1]):
                    names[name.format(i=i, s=s)] = value[i, s].swapaxes(-1, -2) if transpose else value[i, s]
            else:
                names[name.format(i=i)] = value[i].swapaxes(-1, -2) if transpose else value[i]
    for i in range(L):
        names[ROUTER_BIAS.format(i=i)] = router_bias[i]
    return names


def _name(path: str) -> str:
    try:
        return NAMES[path]
    except KeyError:
        raise KeyError(f"parameter {path!r} has no Hugging Face name (marinctl/hf/mapping.py NAMES)") from None


def _contiguous(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a)
