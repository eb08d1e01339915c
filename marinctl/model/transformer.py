"""The hero model (docs/recipe.md §2): embedding → norms → L scanned blocks → norms → untied lm_head.

    h = GatedNorm_e(RMSNorm_e(embed[tokens]))
    for each layer:   x = x + SConv_attn(Attention(GatedNorm_a(RMSNorm_a(x))))
                      x = x + SConv_mlp(LatentMoE(m) + Σ_s Shared_s(m)),  m = GatedNorm_m(RMSNorm_m(x))
    logits = GatedNorm_f(RMSNorm_f(x)) @ lm_head

The blocks are one `Block` whose array leaves carry a leading [L] axis and run under `jax.lax.scan`;
local/global, RoPE on/off, window and KV heads arrive per layer as `LayerFacts` arrays, so there is one
compiled block for all layers. The array leaves equal `marinctl.params.param_table` leaf for leaf.
"""

# ruff: noqa: F722 (jaxtyping shape strings are not Python expressions)

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int, PRNGKeyArray

from marinctl.model.attention import UNBOUNDED_WINDOW, Attention, LayerFacts, kv_head_map, select_impl
from marinctl.model.layers import F32, GatedNorm, RMSNorm, ShortConv, compute_dtype, normalize, shard_batch
from marinctl.model.moe import Experts, LatentMoE, SharedExperts
from marinctl.params import ParamSpec, param_table, partition_spec, tree_paths
from marinctl.recipe import Recipe

UNROLL_MAX_LAYERS = 8  # without remat, models this shallow run their layers unrolled (`features`)
BLOCK_INPUT = "block_input"  # checkpoint_name of each scanned block's input (the residual "offload" moves)

REMAT_POLICIES = {
    "full": None,  # save only the block inputs; recompute the whole block in the backward pass
    "save_dots": jax.checkpoint_policies.dots_saveable,  # keep matmul outputs, recompute the cheap rest
    # "full", but the block inputs (L x [tokens, D], the hero's 36 GiB per GPU) wait out the forward in
    # pinned host memory and come back one layer at a time in the backward. XLA:CPU lowers the host
    # placement as a no-op (CPU memory is host memory); on GPU/TPU it is a real transfer.
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=[BLOCK_INPUT],
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


class Embedding(eqx.Module):
    weight: Float[Array, "v d"]


class LMHead(eqx.Module):
    weight: Float[Array, "d v"]  # untied from the embedding


class Block(eqx.Module):
    """One layer; the scan slices the [L] axis off every leaf. Field order follows docs/recipe.md §2 (and the table)."""

    attn_norm: RMSNorm
    attn_gated_norm: GatedNorm | None
    attention: Attention
    sconv_keys: ShortConv | None
    sconv_values: ShortConv | None
    sconv_attn_out: ShortConv | None
    mlp_norm: RMSNorm
    mlp_gated_norm: GatedNorm | None
    moe: LatentMoE
    sconv_mlp_out: ShortConv | None

    def __call__(
        self,
        x: Float[Array, "b s d"],
        segment_ids: Int[Array, "b s"],
        positions: Int[Array, "b s"],
        facts: LayerFacts,
        router_bias: Float[Array, " e"],
        impl: str = "xla",
        is_global: bool | None = None,
    ) -> tuple[Float[Array, "b s d"], dict[str, Array]]:
        dtype = x.dtype
        a = normalize(self.attn_norm, self.attn_gated_norm, x, dtype)
        h = self.attention(a, segment_ids, positions, facts, self.sconv_keys, self.sconv_values, impl, is_global)
        if self.sconv_attn_out is not None:
            h = self.sconv_attn_out(h, segment_ids)
        x = x + h

        m = normalize(self.mlp_norm, self.mlp_gated_norm, x, dtype)
        B, S, D = m.shape
        valid = (segment_ids != 0).reshape(B * S)  # segment 0 = padding: not routed, not counted
        y, stats = self.moe(m.reshape(B * S, D), router_bias, valid)
        y = y.reshape(B, S, D)
        if self.sconv_mlp_out is not None:
            y = self.sconv_mlp_out(y, segment_ids)
        return x + y, stats


def layer_runs(layer_is_global: tuple[bool, ...]) -> tuple[int, list[tuple[int, int, bool | None]]]:
    """The layer pattern's shortest period P (dividing L) and its runs of same-kind layers [(start, stop,
    is_global)] within one period. The hero's 3 local : 1 global gives P = 4, runs [(0, 3, local), (3, 4,
    global)]: the model scans 3 local layers, then 1 global, L/P times — each layer's kind static, so no
    `lax.cond` between kinds (whose backward saves both kinds' residuals in every layer)."""
    n = len(layer_is_global)
    period = next(
        p for p in range(1, n + 1) if n % p == 0 and all(layer_is_global[i] == layer_is_global[i % p] for i in range(n))
    )
    runs: list[tuple[int, int, bool | None]] = []
    for i, kind in enumerate(layer_is_global[:period]):
        if runs and runs[-1][2] == kind:
            runs[-1] = (runs[-1][0], i + 1, kind)
        else:
            runs.append((i, i + 1, kind))
    return period, runs


def document_positions(segment_ids: Int[Array, "b s"]) -> Int[Array, "b s"]:
    """Position of each token inside its packed document (RoPE and docs/recipe.md §8's length scale read these)."""
    B, S = segment_ids.shape
    idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    starts = jnp.concatenate([jnp.ones((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


class Transformer(eqx.Module):
    """docs/recipe.md §2. `model(tokens, segment_ids, router_bias) -> (logits fp32 [B,S,V], aux)`.

    Segment id 0 is padding; RoPE positions restart at every document. The residual stream is carried
    in the compute dtype (bf16 on GPU: the saved-activation size the planner assumes); every norm reads
    it in fp32. aux holds the per-layer routing statistics stacked over L: beta, expert_load,
    assignments, sender_drops, receiver_drops, router_z.
    """

    embed: Embedding
    embed_norm: RMSNorm | None
    embed_gated_norm: GatedNorm | None
    blocks: Block
    final_norm: RMSNorm
    final_gated_norm: GatedNorm | None
    lm_head: LMHead
    layer_is_global: tuple[bool, ...] = eqx.field(static=True)
    compute_dtype: str = eqx.field(static=True)
    remat: str = eqx.field(static=True)

    def layer_facts(self) -> LayerFacts:
        """Per-layer facts as [L]-stacked constants (recipe §1, §2: global ⇒ no window, NoPE, first KV heads)."""
        att = self.blocks.attention
        cfg, H = att.config, att.num_heads
        is_global = np.asarray(self.layer_is_global)
        local_map = kv_head_map(H, cfg.local_kv_heads)
        global_map = kv_head_map(H, cfg.global_kv_heads)
        return LayerFacts(
            is_global=jnp.asarray(is_global),
            window=jnp.asarray(np.where(is_global, UNBOUNDED_WINDOW, cfg.window), jnp.int32),
            rope=jnp.asarray(~is_global | (not cfg.nope_global)),
            kv_of_head=jnp.asarray([global_map if g else local_map for g in is_global], jnp.int32),
        )

    def __call__(
        self, tokens: Int[Array, "b s"], segment_ids: Int[Array, "b s"], router_bias: Float[Array, "layers e"]
    ) -> tuple[Float[Array, "b s v"], dict[str, Array]]:
        h, stats = self.features(tokens, segment_ids, router_bias)
        logits = jnp.einsum("bsd,dv->bsv", h, self.lm_head.weight.astype(h.dtype), preferred_element_type=F32)
        return logits, stats

    def features(
        self, tokens: Int[Array, "b s"], segment_ids: Int[Array, "b s"], router_bias: Float[Array, "layers e"]
    ) -> tuple[Float[Array, "b s d"], dict[str, Array]]:
        """Everything before the lm_head: the final normed hidden states (compute dtype) and the MoE stats.
        The chunked loss (`marinctl.model.loss`) applies the lm_head itself, a token chunk at a time."""
        dtype = compute_dtype(self.compute_dtype)
        impl = select_impl(self.blocks.attention.config.impl, dtype)
        positions = document_positions(segment_ids)

        x = jnp.take(self.embed.weight, tokens, axis=0)
        if self.embed_norm is not None:  # unit-scale input however large Adam grows the embedding
            x = normalize(self.embed_norm, self.embed_gated_norm, x, dtype)
        x = shard_batch(x.astype(dtype))

        def layer_of(is_global: bool | None) -> Callable[[Array, tuple], tuple[Array, dict[str, Array]]]:
            def layer(x, inputs):
                block, facts, bias = inputs
                x = checkpoint_name(shard_batch(x), BLOCK_INPUT)  # the one residual "offload" sends to the host
                x, stats = block(x, segment_ids, positions, facts, bias, impl, is_global)
                return shard_batch(x), stats

            if self.remat != "none":
                layer = jax.checkpoint(layer, policy=REMAT_POLICIES[self.remat], prevent_cse=False)
            return layer

        # Without remat, one scan per run of same-kind layers: a `lax.cond` between kinds would save both
        # kinds' residuals (the global S² ones included) for every layer (+10% tokens/s on the tiny recipe at
        # seq 256, +32% at 1024). With remat only the block inputs are saved, so one scan over all layers
        # with the cond inside keeps XLA's schedule — and the memory planner's figures — as they are.
        # A model of at most UNROLL_MAX_LAYERS layers without remat runs its layers as straight-line code:
        # the scan's stacked residual buffers (zero-filled, written and read by dynamic slices) cost the tiny
        # recipe ~9% of its step, more than the few extra layer bodies cost to compile.
        L = len(self.layer_is_global)
        period, runs = layer_runs(self.layer_is_global) if self.remat == "none" else (L, [(0, L, None)])
        layers = {kind: layer_of(kind) for kind in {kind for _, _, kind in runs}}
        unroll = self.remat == "none" and L <= UNROLL_MAX_LAYERS

        def group(x, inputs):  # one period of the layer pattern: a scan per run of same-kind layers
            stats = []
            for start, stop, kind in runs:
                part = jax.tree.map(lambda a, start=start, stop=stop: a[start:stop], inputs)
                x, run_stats = jax.lax.scan(layers[kind], x, part)
                stats.append(run_stats)
            return x, jax.tree.map(lambda *s: jnp.concatenate(s), *stats)

        inputs = (self.blocks, self.layer_facts(), router_bias)
        groups = L // period
        if unroll:
            stats = []
            for i, kind in enumerate(self.layer_is_global):
                x, layer_stats = layers[kind](x, jax.tree.map(lambda a, i=i: a[i], inputs))
                stats.append(layer_stats)
            stats = jax.tree.map(lambda *s: jnp.stack(s), *stats)
        elif groups == 1:
            x, stats = group(x, inputs)
        else:  # [L, ...] -> [G, P, ...]: an outer scan over the pattern's repeats, stats back to [L, ...]
            grouped = jax.tree.map(lambda a: a.reshape(groups, period, *a.shape[1:]), inputs)
            x, stats = jax.lax.scan(group, x, grouped)
            stats = jax.tree.map(lambda a: a.reshape(groups * period, *a.shape[2:]), stats)

        return normalize(self.final_norm, self.final_gated_norm, x, dtype), stats


# --------------------------------------------------------------------------------------------------
# Construction from the parameter table.


def init_params(recipe: Recipe, key: PRNGKeyArray) -> dict[str, Array]:
    """Every leaf of `param_table(recipe)` initialized per its spec, fp32 (docs/recipe.md §1, §2).

    "normal": init_scale/√D · truncated_normal(−3, 3) for every matrix (D the residual width, for all of
    them); "ones"/"zeros"; "identity_conv": w[lag 0] = 1, other lags 0. Each leaf's key folds in a hash
    of its path, so adding a leaf never changes the others' values.
    """
    m = recipe.model
    std = m.init_scale / math.sqrt(m.hidden)
    sizes = None  # draw each leaf in its own shape, unless `draw_shape` may merge dims
    if _draws_in_row_major(key):
        mesh = jax.sharding.get_abstract_mesh()
        sizes = {} if mesh.empty else dict(mesh.shape)
    return {
        path: _init_leaf(spec, jax.random.fold_in(key, zlib.crc32(path.encode()) & 0x7FFFFFFF), std, sizes)
        for path, spec in param_table(recipe).items()
    }


def _draws_in_row_major(key: PRNGKeyArray) -> bool:
    """Whether `key`'s draws number their elements row-major whatever the shape (`draw_shape`)."""
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    return typed and str(jax.random.key_impl(key)) == "threefry2x32" and bool(jax.config.jax_threefry_partitionable)


def draw_shape(spec: ParamSpec, mesh: Mapping[str, int]) -> tuple[int, ...]:
    """The shape a leaf's random draw is made in: its dims up to the last one `partition_spec` shards on
    `mesh`, then the rest merged into one. Partitionable threefry numbers the elements in row-major order
    whatever the shape, so the values are the same as drawn in `spec.shape` (on any mesh), each device still
    draws only its shard, and XLA:CPU compiles a 1-D draw in a fraction of the time of a 3- or 4-D one (the
    tiny recipe's initializer: 5.5 → 1.6 s, bench/README.md stops 30–32)."""
    parts = partition_spec(spec, dict(mesh))
    last = max((i for i, part in enumerate(parts) if part is not None), default=-1)
    if last == len(spec.shape) - 1:
        return spec.shape
    return (*spec.shape[: last + 1], math.prod(spec.shape[last + 1 :]))


def _init_leaf(spec: ParamSpec, key: PRNGKeyArray, std: float, mesh: Mapping[str, int] | None) -> Array:
    """One leaf; `mesh` (axis sizes) picks the shape of a normal draw (`draw_shape`), None draws it whole."""
    if spec.init == "normal":
        shape = spec.shape if mesh is None else draw_shape(spec, mesh)
        draw = jax.random.truncated_normal(key, -3.0, 3.0, shape, F32)
        return std * draw.reshape(spec.shape)
    if spec.init == "ones":
        return jnp.ones(spec.shape, F32)
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, F32)
    if spec.init == "identity_conv":
        lag = spec.axes.index("conv")
        first = (jnp.arange(spec.shape[lag]) == 0).astype(F32)
        return jnp.broadcast_to(first.reshape([-1 if i == lag else 1 for i in range(len(spec.shape))]), spec.shape)
    raise ValueError(f"unknown init {spec.init!r}")


def build_model(recipe: Recipe, params: Mapping[str, Array]) -> Transformer:
    """Assemble the module tree from a {dotted path: array} mapping that covers `param_table(recipe)`."""
    m, a, moe = recipe.model, recipe.attention, recipe.moe
    table = param_table(recipe)
    missing, extra = sorted(set(table) - set(params)), sorted(set(params) - set(table))
    if missing or extra:
        raise ValueError(f"parameters do not match the table: missing {missing[:3]}, unexpected {extra[:3]}")
    p = params

    def norm(prefix: str) -> RMSNorm:
        return RMSNorm(p[f"{prefix}_norm.gain"], eps=m.norm_eps)

    def gated(prefix: str) -> GatedNorm | None:
        if not m.gated_norm:
            return None
        return GatedNorm(p[f"{prefix}_gated_norm.w_down"], p[f"{prefix}_gated_norm.w_up"])

    def sconv(site: str) -> ShortConv | None:
        return ShortConv(p[f"blocks.sconv_{site}.weight"]) if site in m.sconv_sites else None

    attention = Attention(
        w_q=p["blocks.attention.w_q"],
        w_k=p["blocks.attention.w_k"],
        w_v=p["blocks.attention.w_v"],
        w_o=p["blocks.attention.w_o"],
        w_gate=p.get("blocks.attention.w_gate"),
        qk_mult=p.get("blocks.attention.qk_mult"),
        config=a,
        num_heads=m.num_heads,
        head_dim=m.head_dim,
    )
    shared = None
    if moe.shared_experts:
        shared = SharedExperts(*(p[f"blocks.moe.shared.{w}"] for w in ("w_gate", "w_up", "w_down")))
    latent_norm = None
    if "blocks.moe.latent_norm.gain" in p:
        latent_norm = RMSNorm(p["blocks.moe.latent_norm.gain"], eps=m.norm_eps)
    latent_moe = LatentMoE(
        router=p["blocks.moe.router"],
        latent_down=p.get("blocks.moe.latent_down"),
        latent_norm=latent_norm,
        experts=Experts(*(p[f"blocks.moe.experts.{w}"] for w in ("w_gate", "w_up", "w_down"))),
        latent_up=p.get("blocks.moe.latent_up"),
        shared=shared,
        config=moe,
    )
    blocks = Block(
        attn_norm=norm("blocks.attn"),
        attn_gated_norm=gated("blocks.attn"),
        attention=attention,
        sconv_keys=sconv("keys"),
        sconv_values=sconv("values"),
        sconv_attn_out=sconv("attn_out"),
        mlp_norm=norm("blocks.mlp"),
        mlp_gated_norm=gated("blocks.mlp"),
        moe=latent_moe,
        sconv_mlp_out=sconv("mlp_out"),
    )
    return Transformer(
        embed=Embedding(p["embed.weight"]),
        embed_norm=norm("embed") if m.embed_norm else None,
        embed_gated_norm=gated("embed") if m.embed_norm else None,
        blocks=blocks,
        final_norm=norm("final"),
        final_gated_norm=gated("final"),
        lm_head=LMHead(p["lm_head.weight"]),
        layer_is_global=recipe.layer_is_global(),
        compute_dtype=m.compute_dtype,
        remat=m.remat,
    )


def init_model(recipe: Recipe, key: PRNGKeyArray) -> Transformer:
    """A freshly initialized model (fp32 master weights). `eqx.filter_eval_shape(init_model, ...)` gives the
    abstract tree for sharding plans; under `jax.jit(..., out_shardings=...)` it initializes in place."""
    return build_model(recipe, init_params(recipe, key))


def model_params(model: Transformer) -> dict[str, Array]:
    """{dotted path: array} for every parameter leaf — the inverse of `build_model`."""
    paths = jax.tree_util.tree_leaves(tree_paths(model))
    return dict(zip(paths, jax.tree_util.tree_leaves(model), strict=True))
