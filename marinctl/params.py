"""The parameter table: every leaf of the model, its shape, logical axes and optimizer group.

One table serves four readers, so they cannot disagree: the planner counts it, the model's tree must
match it leaf for leaf (a test checks), the optimizer groups and hyperball norm scopes read it, and the
sharding rules map its logical axes onto the mesh. Paths are the equinox attribute paths joined by '.'.

Logical axes: "layers" (scan-stacked blocks), "experts", "shared" (shared-expert stack), and
dimension names ("embed", "vocab", "q", "kv", "heads", "latent", "mlp", "rank", "conv", "experts_out").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from marinctl.recipe import ParallelConfig, Recipe

Group = Literal["adam", "adamh", "muonh"]

# Hyperball norms are frozen per matrix; these leading axes index separate matrices. The experts axis
# is deliberately absent: an expert stack keeps one norm per layer, jointly over its experts (docs/recipe.md §5).
NORM_KEEP_AXES = ("layers", "shared")
# Newton-Schulz orthogonalizes each matrix separately: per layer, per expert, per shared expert.
MATRIX_BATCH_AXES = ("layers", "experts", "shared")


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    group: Group
    init: Literal["normal", "ones", "zeros", "identity_conv"]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def is_matrix(self) -> bool:
        """A matmul weight: what 'matmul weights' counts and what MuonH/AdamH act on."""
        return self.group in ("muonh", "adamh")


def param_table(recipe: Recipe) -> dict[str, ParamSpec]:
    """Every parameter leaf of the model for this recipe, in the order of docs/recipe.md §2."""
    m, a, moe = recipe.model, recipe.attention, recipe.moe
    D, V, L, H, Dh = m.hidden, m.vocab_size, m.num_layers, m.num_heads, m.head_dim
    kv, r, k = recipe.stored_kv_heads, m.gated_norm_rank, m.sconv_kernel
    E, I = moe.num_experts, moe.expert_width
    width = moe.latent_width if moe.latent else D  # experts' input/output width
    t: dict[str, ParamSpec] = {}

    def matrix(path: str, shape: tuple[int, ...], axes: tuple[str, ...], group: Group = "muonh") -> None:
        t[path] = ParamSpec(shape, axes, group, "normal")

    def norm(prefix: str, dim: int, layered: bool) -> None:
        lead, lead_axes = ((L,), ("layers",)) if layered else ((), ())
        t[f"{prefix}_norm.gain"] = ParamSpec((*lead, dim), (*lead_axes, "embed"), "adam", "ones")
        if m.gated_norm:
            matrix(f"{prefix}_gated_norm.w_down", (*lead, dim, r), (*lead_axes, "embed", "rank"))
            matrix(f"{prefix}_gated_norm.w_up", (*lead, r, dim), (*lead_axes, "rank", "embed"))

    def sconv(site: str, channels: int, axis: str) -> None:
        if site in m.sconv_sites:
            t[f"blocks.sconv_{site}.weight"] = ParamSpec(
                (L, k, channels), ("layers", "conv", axis), "adam", "identity_conv"
            )

    t["embed.weight"] = ParamSpec((V, D), ("vocab", "embed"), "adam", "normal")
    if m.embed_norm:
        norm("embed", D, layered=False)

    norm("blocks.attn", D, layered=True)
    matrix("blocks.attention.w_q", (L, D, H * Dh), ("layers", "embed", "q"))
    matrix("blocks.attention.w_k", (L, D, kv * Dh), ("layers", "embed", "kv"))
    matrix("blocks.attention.w_v", (L, D, kv * Dh), ("layers", "embed", "kv"))
    matrix("blocks.attention.w_o", (L, H * Dh, D), ("layers", "q", "embed"))
    if a.gate:
        t["blocks.attention.w_gate"] = ParamSpec((L, D, H), ("layers", "embed", "heads"), "adam", "zeros")
    if a.qk_mult_learnable:
        t["blocks.attention.qk_mult"] = ParamSpec((L, H), ("layers", "heads"), "adam", "ones")
    sconv("keys", kv * Dh, "kv")
    sconv("values", kv * Dh, "kv")
    sconv("attn_out", D, "embed")

    norm("blocks.mlp", D, layered=True)
    t["blocks.moe.router"] = ParamSpec((L, D, E), ("layers", "embed", "experts_out"), "adam", "normal")
    if moe.latent:
        matrix("blocks.moe.latent_down", (L, D, width), ("layers", "embed", "latent"))
        if moe.latent_norm:
            t["blocks.moe.latent_norm.gain"] = ParamSpec((L, width), ("layers", "latent"), "adam", "ones")
    matrix("blocks.moe.experts.w_gate", (L, E, width, I), ("layers", "experts", "latent", "mlp"))
    matrix("blocks.moe.experts.w_up", (L, E, width, I), ("layers", "experts", "latent", "mlp"))
    matrix("blocks.moe.experts.w_down", (L, E, I, width), ("layers", "experts", "mlp", "latent"))
    if moe.latent:
        matrix("blocks.moe.latent_up", (L, width, D), ("layers", "latent", "embed"))
    if moe.shared_experts:
        n, Ish = moe.shared_experts, moe.shared_width
        matrix("blocks.moe.shared.w_gate", (L, n, D, Ish), ("layers", "shared", "embed", "mlp"))
        matrix("blocks.moe.shared.w_up", (L, n, D, Ish), ("layers", "shared", "embed", "mlp"))
        matrix("blocks.moe.shared.w_down", (L, n, Ish, D), ("layers", "shared", "mlp", "embed"))
    sconv("mlp_out", D, "embed")

    norm("final", D, layered=False)
    matrix("lm_head.weight", (D, V), ("embed", "vocab"), group="adamh")
    return t


# --------------------------------------------------------------------------------------------------
# Mesh shape and sharding rules (shared by the planner's memory estimate and the real mesh).

MESH_AXES = ("replica", "data", "expert")


def resolve_mesh_shape(parallel: ParallelConfig, n_devices: int) -> dict[str, int]:
    """Mesh sizes for `n_devices`; a -1 axis takes whatever the others leave. Raises ValueError."""
    sizes = {"replica": parallel.replica, "data": parallel.data, "expert": parallel.expert}
    fixed = math.prod(v for v in sizes.values() if v > 0)
    for name, value in sizes.items():
        if value == -1:
            if n_devices % fixed:
                raise ValueError(f"{n_devices} devices do not divide into fixed axes of size {fixed}")
            sizes[name] = n_devices // fixed
    if math.prod(sizes.values()) != n_devices:
        raise ValueError(
            f"mesh replica={sizes['replica']} x data={sizes['data']} x expert={sizes['expert']} "
            f"needs {math.prod(sizes.values())} devices, {n_devices} present"
        )
    return sizes


def recipe_device_count(parallel: ParallelConfig) -> int | None:
    """Devices the recipe's mesh names explicitly (None when an axis is -1, i.e. 'fill')."""
    if parallel.data == -1 or parallel.expert == -1:
        return None
    return parallel.replica * parallel.data * parallel.expert


def partition_spec(spec: ParamSpec, mesh: dict[str, int]) -> tuple[str | tuple[str, ...] | None, ...]:
    """Mesh axes per dim: experts over `expert`, then FSDP of the largest divisible other dim.

    Expert stacks are FSDP-sharded over `data`; everything else over `data` x `expert` jointly. Why
    both: the hero's data axis inside a rack is 1, so FSDP over `data` alone would replicate ~14B
    non-expert weights on all 64 GPUs of a rack. The `layers` axis is never sharded (scan slices it);
    the `replica` axis is pure data parallelism across racks. Leaves with no divisible dim replicate.
    """
    parts: list[str | tuple[str, ...] | None] = [None] * len(spec.shape)
    fsdp: tuple[str, ...] = ("data", "expert")
    if "experts" in spec.axes:
        parts[spec.axes.index("experts")] = "expert" if mesh.get("expert", 1) > 1 else None
        fsdp = ("data",)
    fsdp = tuple(ax for ax in fsdp if mesh.get(ax, 1) > 1)
    if fsdp:
        ways = math.prod(mesh[ax] for ax in fsdp)
        candidates = [
            i
            for i, (n, ax) in enumerate(zip(spec.shape, spec.axes, strict=True))
            if parts[i] is None and ax not in ("layers", "shared", "conv") and n % ways == 0
        ]
        if candidates:
            best = max(candidates, key=lambda i: spec.shape[i])
            parts[best] = fsdp if len(fsdp) > 1 else fsdp[0]
    return tuple(parts)


def shard_size(spec: ParamSpec, mesh: dict[str, int]) -> int:
    """Elements of this leaf held by one device under `partition_spec`."""
    size = 1
    for n, part in zip(spec.shape, partition_spec(spec, mesh), strict=True):
        axes = (part,) if isinstance(part, str) else (part or ())
        size *= n // math.prod(mesh[a] for a in axes)
    return size


# The mesh axes Newton-Schulz spreads whole matrices over (marinctl/optim/muon.py `spread_matrices`): the ones
# parameters are sharded on, `expert` first because an expert stack already arrives split over it. Not
# `replica`: it crosses the data-centre network, where moving the matrices out and the results back costs
# more than the replicated iterations it would save.
NS_SPREAD_AXES = ("expert", "data")


def ns_spread_axes(mesh: dict[str, int]) -> tuple[str, ...]:
    """The `NS_SPREAD_AXES` of size > 1 in this mesh (none: Newton-Schulz runs on the leaf as sharded)."""
    return tuple(ax for ax in NS_SPREAD_AXES if mesh.get(ax, 1) > 1)


def ns_spread_ways(mesh: dict[str, int]) -> int:
    """Devices Newton-Schulz spreads each matrix stack over (1: it runs on the leaf as sharded)."""
    return math.prod(mesh[ax] for ax in ns_spread_axes(mesh))


def ns_shard_size(spec: ParamSpec, mesh: dict[str, int]) -> int:
    """Elements of one Newton-Schulz iterate per device: ceil(matrices / ways) whole matrices when spread."""
    ways = ns_spread_ways(mesh)
    if ways == 1 or len(spec.shape) < 3:
        return shard_size(spec, mesh)
    return -(-math.prod(spec.shape[:-2]) // ways) * math.prod(spec.shape[-2:])


def path_str(path: tuple) -> str:
    """A jax key path as the dotted string the table uses ('blocks.attention.w_q')."""
    parts = []
    for key in path:
        for attr in ("name", "key", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
    return ".".join(parts)


def tree_paths(tree):
    """Same structure as `tree`, each array leaf replaced by its dotted path (for optax labels etc.)."""
    import jax

    return jax.tree_util.tree_map_with_path(lambda p, _: path_str(p), tree)


def spec_for(path: str, table: dict[str, ParamSpec]) -> ParamSpec:
    try:
        return table[path]
    except KeyError:
        raise KeyError(f"parameter {path!r} is not in the parameter table (marinctl/params.py)") from None
