"""Attention (docs/recipe.md §2): GQA with per-layer KV heads, QK RMSNorm × qk_mult, partial RoPE on local layers,
NoPE on global layers, causal sliding window, packed-document masking, XSA and the head-wise gate.

One module serves every layer: whether a layer is local or global arrives as `LayerFacts` arrays
(scanned over layers), so all layers share one compiled block (the "template-first" rule). On the XLA
path a `lax.cond` on that traced fact runs only the kind's own work: local layers a banded computation
over the key blocks inside the window (S·1.5W scores), global layers the block-causal square; both run
each KV head's query heads as one matmul's rows, so K/V are never copied per head. The cuDNN path takes
the mask and gathered K/V.
"""

# ruff: noqa: F722 (jaxtyping shape strings are not Python expressions)

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from marinctl.errors import UserError
from marinctl.model.attention_blocks import band_shape, causal_bounds
from marinctl.model.layers import F32, ShortConv, linear, rms_norm
from marinctl.recipe import AttentionConfig

# Keys beyond a global layer's reach: larger than any sequence, small enough for int32 arithmetic.
UNBOUNDED_WINDOW = 2**30
XSA_EPS = 1e-6  # docs/recipe.md §2.6
LOG_LENGTH_BASE = 65536  # docs/recipe.md §8: global layers' query scale starts beyond 65k tokens


class LayerFacts(eqx.Module):
    """What differs between layers, as traced values (leading [L] axis when stacked for the scan)."""

    is_global: Bool[Array, ""]
    window: Int[Array, ""]  # key j is visible from query i iff 0 ≤ i − j < window
    rope: Bool[Array, ""]  # RoPE on (local layers) or off (NoPE global layers)
    kv_of_head: Int[Array, " heads"]  # stored KV head each query head reads (GQA; global: first kv only)


def kv_head_map(num_heads: int, kv_heads: int) -> list[int]:
    """GQA grouping: query head h reads KV head h // (H / kv) — so a layer using fewer KV heads uses the
    first `kv_heads` of the stored ones (docs/recipe.md §2.2)."""
    group = num_heads // kv_heads
    return [h // group for h in range(num_heads)]


def rope(
    x: Float[Array, "b s h d"], positions: Int[Array, "b s"], rotary_dims: int, theta: float, on: Bool[Array, ""]
) -> Float[Array, "b s h d"]:
    """Partial RoPE, split-halves convention, on the first `rotary_dims` dims of each head.

    Pairs are (i, i + R/2) for i < R/2 with R = rotary_dims (GPT-NeoX / Llama-HF layout, not adjacent
    pairs); frequency θ^(−2i/R). Dims ≥ R pass through untouched. Export to other formats must keep
    this pairing. `on` = False is an exact identity (cos 1, sin 0), which is how NoPE layers share the
    compiled block.
    """
    if rotary_dims == 0:
        return x
    half = rotary_dims // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=F32) * 2.0 / rotary_dims)
    angle = positions.astype(F32)[..., None] * inv_freq  # [b, s, half]
    cos = jnp.where(on, jnp.cos(angle), 1.0)[:, :, None, :]
    sin = jnp.where(on, jnp.sin(angle), 0.0)[:, :, None, :]
    return _rotate(x, cos, sin)


def _rotate_halves(x: Array, cos: Array, sin: Array) -> Array:
    """(x1, x2, rest) -> (x1·cos − x2·sin, x2·cos + x1·sin, rest), in fp32, with x1, x2 the two halves of
    the first 2·cos.shape[-1] dims."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half].astype(F32), x[..., half : 2 * half].astype(F32), x[..., 2 * half :]
    r1 = (x1 * cos - x2 * sin).astype(x.dtype)
    r2 = (x2 * cos + x1 * sin).astype(x.dtype)
    return jnp.concatenate([r1, r2, rest], axis=-1)


@jax.custom_vjp
def _rotate(x: Array, cos: Array, sin: Array) -> Array:
    """`_rotate_halves`, whose backward is the rotation by −angle written like the forward: slices of the
    cotangent and one concatenation. Autodiff transposes each slice to a pad and sums the pads, 8.7 ms of
    pad fusions per tiny step (bench/README.md, stop 42); the products and sums are autodiff's own, in its
    order, so the gradient is the same bit for bit."""
    return _rotate_halves(x, cos, sin)


def _rotate_fwd(x, cos, sin):
    return _rotate_halves(x, cos, sin), (cos, sin)


def _rotate_bwd(residuals, grad):
    cos, sin = residuals  # from positions: no gradient flows to them
    half = cos.shape[-1]
    g1, g2, rest = grad[..., :half].astype(F32), grad[..., half : 2 * half].astype(F32), grad[..., 2 * half :]
    d1 = (g2 * sin + g1 * cos).astype(grad.dtype)  # autodiff's terms in autodiff's order: the same bits
    d2 = (g2 * cos + -g1 * sin).astype(grad.dtype)
    return jnp.concatenate([d1, d2, rest], axis=-1), None, None


_rotate.defvjp(_rotate_fwd, _rotate_bwd)


def log_length_scale(positions: Int[Array, "b s"]) -> Float[Array, "b s"]:
    """docs/recipe.md §8: `(1 + 0.1·ln(n / 65,536))²` for a query that sees n = position + 1 tokens, floored at 1
    (exactly 1 up to 65,536 tokens, 1.143 at 131k, 1.296 at 262k). Global layers only."""
    n = jnp.maximum(positions.astype(F32) + 1.0, LOG_LENGTH_BASE)
    return (1.0 + 0.1 * jnp.log(n / LOG_LENGTH_BASE)) ** 2


def attention_mask(segment_ids: Int[Array, "b s"], window: Int[Array, ""]) -> Bool[Array, "b s s"]:
    """Causal ∧ sliding window ∧ same document. Padding (segment 0) attends only to padding, so no row
    is ever empty (the diagonal is always allowed) and real tokens never see padding."""
    i = jnp.arange(segment_ids.shape[1])[:, None]
    j = jnp.arange(segment_ids.shape[1])[None, :]
    local = (j <= i) & (i - j < window)
    return local[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])


def masked_softmax_attention(
    q: Float[Array, "b s h d"], k: Float[Array, "b s h d"], v: Float[Array, "b s h d"], mask: Bool[Array, "b s s"]
) -> Float[Array, "b s h d"]:
    """The plain full-square path, K/V given per query head: scores and softmax in fp32, scale 1/√Dh (the
    oracle the blocked and banded paths are tested against)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=F32) * scale
    probs = _softmax_rows(scores, mask[:, None], v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def _grouped_queries(q: Float[Array, "b s h d"], kv_heads: int) -> Float[Array, "b kv g s d"]:
    """Query head h = kv·G + g reads KV head kv (the `kv_head_map` grouping). Heads move in front of the
    sequence: XLA:CPU runs the batched matmuls ~2× faster in that layout."""
    B, S, H, Dh = q.shape
    return q.reshape(B, S, kv_heads, H // kv_heads, Dh).transpose(0, 2, 3, 1, 4)


def _ungroup(y: Float[Array, "b kv g s d"], length: int) -> Float[Array, "b s h d"]:
    B, KV, G, _, Dh = y.shape
    return y[:, :, :, :length].transpose(0, 3, 1, 2, 4).reshape(B, length, KV * G, Dh)


def _softmax_rows(scores: Float[Array, "..."], mask: Bool[Array, "..."], dtype: jnp.dtype) -> Array:
    return jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(F32).min), axis=-1).astype(dtype)


def full_attention(
    q: Float[Array, "b s h d"],
    k: Float[Array, "b s kv d"],
    v: Float[Array, "b s kv d"],
    segment_ids: Int[Array, "b s"],
    window: Int[Array, ""],
    blocks: int | None = None,
) -> Float[Array, "b s h d"]:
    """Causal attention over the whole sequence (global layers), grouped GQA, the square cut into `blocks`
    query blocks (default `causal_blocks`), block i computing only the keys up to its own end: every
    skipped score lies above the diagonal, where the causal mask is 0, so the result equals the full masked
    square's (the mask, window and documents included, inside each block).

    Each KV head's G query heads are one matmul's rows (`_grouped_rows`), so K/V are never copied per head
    and their gradient needs no sum over heads; the scores keep the per-head layout (a free reshape).
    """
    B, S, H, Dh = q.shape
    kv = k.shape[2]
    # Batch and KV head as one batch axis: 4-D scores [b·kv, g, q, k], which XLA:CPU reduces faster than 5-D.
    mask = jnp.broadcast_to(attention_mask(segment_ids, window)[:, None], (B, kv, S, S)).reshape(B * kv, 1, S, S)
    qg = _grouped_queries(q, kv).reshape(B * kv, H // kv, S, Dh)
    kh, vh = (jnp.swapaxes(t, 1, 2).reshape(B * kv, S, Dh) for t in (k, v))
    bounds = causal_bounds(S, blocks)
    outs = [
        _grouped_rows(qg[:, :, lo:hi], kh[:, :hi], vh[:, :hi], mask[:, :, lo:hi, :hi])
        for lo, hi in itertools.pairwise(bounds)
    ]
    y = jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]
    return _ungroup(y.reshape(B, kv, H // kv, S, Dh), S)


def _grouped_rows(
    q: Float[Array, "*batch g q d"],
    k: Float[Array, "*batch k d"],
    v: Float[Array, "*batch k d"],
    mask: Bool[Array, "..."],
) -> Float[Array, "*batch g q d"]:
    """Attention of G query heads that share one KV head, their rows stacked into one [G·q, d] operand:
    plain batched matmuls on XLA:CPU (no broadcast K/V, no per-head transposes of the scores; the K/V
    gradients come out of one matmul each). Forward + backward, measured 1.2-1.5× faster than per-head
    matmuls over broadcast K/V (bench/README.md). `mask` broadcasts against the [*batch, g, q, k] scores."""
    *batch, G, Q, Dh = q.shape
    scale = 1.0 / math.sqrt(Dh)
    rows = q.reshape(*batch, G * Q, Dh)
    scores = jnp.einsum("...md,...kd->...mk", rows, k, preferred_element_type=F32) * scale
    probs = _softmax_rows(scores.reshape(*batch, G, Q, k.shape[-2]), mask, v.dtype)
    y = jnp.einsum("...mk,...kd->...md", probs.reshape(*batch, G * Q, k.shape[-2]), v)
    return y.reshape(*batch, G, Q, Dh)


def banded_attention(
    q: Float[Array, "b s h d"],
    k: Float[Array, "b s kv d"],
    v: Float[Array, "b s kv d"],
    segment_ids: Int[Array, "b s"],
    window: Int[Array, ""],
    max_window: int,
    block: int | None = None,
) -> Float[Array, "b s h d"]:
    """Sliding-window attention that computes only the key blocks a query block can see.

    The sequence is cut into query blocks of `block` positions (default `band_block`); block c reads the
    `1 + ⌈(max_window − 1)/block⌉` key blocks ending at its own, which cover every key within the window
    of each of its queries. Scores cost S·(block + max_window) instead of S². The exact mask (causal ∧
    window ∧ same document, `window` ≤ `max_window`, traced) is applied inside the band, so the result
    equals `full_attention`; the sequence is padded to whole blocks (padded keys lie after every real
    query, padded queries are dropped) and the band's front is padded with segment id −1, which no real
    token carries.
    """
    B, S, H, Dh = q.shape
    kv = k.shape[2]
    shape = band_shape(S, max_window, block)
    if shape is None:
        return full_attention(q, k, v, segment_ids, window)
    bq, n, nk = shape  # query block, query blocks, key blocks per query block (its own included)
    front, back = (nk - 1) * bq, n * bq - S

    # [b, kv, n, g, bq, d]: each query block's G heads per KV head, batched over (b, kv, n)
    qg = jnp.pad(_grouped_queries(q, kv), ((0, 0),) * 3 + ((0, back), (0, 0)))
    qg = qg.reshape(B, kv, H // kv, n, bq, Dh).transpose(0, 1, 3, 2, 4, 5)

    def band(x: Array, fill: int | float = 0) -> Array:
        """[b, (kv,) s, ...] -> [b, (kv,) n, nk·bq, ...]: for each query block, its key blocks side by side."""
        seq_axis = 1 if x.ndim == 2 else 2
        pad = [(0, 0)] * x.ndim
        pad[seq_axis] = (front, back)
        x = jnp.pad(x, pad, constant_values=fill)
        x = x.reshape(*x.shape[:seq_axis], n + nk - 1, bq, *x.shape[seq_axis + 1 :])
        parts = [jax.lax.slice_in_dim(x, j, j + n, axis=seq_axis) for j in range(nk)]
        return jnp.concatenate(parts, axis=seq_axis + 1)

    kb = band(jnp.swapaxes(k, 1, 2))  # [b, kv, n, nk·bq, d]
    vb = band(jnp.swapaxes(v, 1, 2))
    seg_k = band(segment_ids, -1)  # [b, n, nk·bq]
    seg_q = jnp.pad(segment_ids, ((0, 0), (0, back)), constant_values=-1).reshape(B, n, bq)
    pos_q = (jnp.arange(n) * bq)[:, None, None] + jnp.arange(bq)[None, :, None]  # [n, bq, 1]
    pos_k = (jnp.arange(n) * bq - front)[:, None, None] + jnp.arange(nk * bq)[None, None, :]  # [n, 1, nk·bq]
    mask = (pos_k <= pos_q) & (pos_q - pos_k < window) & (seg_q[..., :, None] == seg_k[..., None, :])

    y = _grouped_rows(qg, kb, vb, mask[:, None, :, None])  # [b, kv, n, g, bq, d]
    return _ungroup(y.transpose(0, 1, 3, 2, 4, 5).reshape(B, kv, H // kv, n * bq, Dh), S)


def exclusive_self_attention(y: Float[Array, "b s h d"], v: Float[Array, "b s kv d"]) -> Float[Array, "b s h d"]:
    """docs/recipe.md §2.6 (XSA): drop from each head's output its component along the token's own value vector (the
    KV head it reads, grouped like the queries, never expanded)."""
    B, S, H, Dh = y.shape
    kv = v.shape[2]
    if kv == 1:
        # One KV head (the tiny recipe's global layer; the hero's have 6): [b, s, 1, d] broadcasts over the heads. The
        # grouped 5-D form's two unit axes ran forward + backward ~12x slower on XLA:CPU (14.1 vs 1.0 ms at
        # [8, 256, 4, 64]; bench/README.md, stop 34).
        y32, v32 = y.astype(F32), v.astype(F32)
    else:
        y32 = y.astype(F32).reshape(B, S, kv, H // kv, Dh)
        v32 = v.astype(F32)[:, :, :, None]
    coef = jnp.sum(y32 * v32, -1, keepdims=True) / (jnp.sum(v32 * v32, -1, keepdims=True) + XSA_EPS)
    return (y32 - coef * v32).reshape(B, S, H, Dh).astype(y.dtype)


def fused_attention(
    q: Float[Array, "b s h d"],
    k: Float[Array, "b s h d"],
    v: Float[Array, "b s h d"],
    mask: Bool[Array, "b s s"],
    implementation: str,
) -> Float[Array, "b s h d"]:
    """`jax.nn.dot_product_attention` (cuDNN flash attention on GPU). `is_causal` lets cuDNN skip the upper
    triangle; the window and documents, traced per layer, ride in the boolean mask."""
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], is_causal=True, implementation=implementation)


def select_impl(impl: str, dtype: jnp.dtype) -> str:
    """`attention.impl`: "auto" takes cuDNN only on a GPU with a 16-bit compute dtype (cuDNN flash attention
    has no f32 kernel); the plain XLA path everywhere else. Never cuDNN on CPU."""
    on_gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    half = jnp.dtype(dtype).itemsize == 2
    if impl == "cudnn":
        if not on_gpu:
            raise UserError(f"attention.impl = 'cudnn' needs a GPU (backend is {jax.default_backend()}); use 'auto'")
        if not half:
            raise UserError("attention.impl = 'cudnn' needs model.compute_dtype = 'bfloat16' (cuDNN has no f32 path)")
        return "cudnn"
    if impl == "auto" and on_gpu and half:
        return "cudnn"
    return "xla"


class Attention(eqx.Module):
    """docs/recipe.md §2 attention on the normalized input `a`. Weights `[in, out]`; heads are contiguous Dh slices."""

    w_q: Float[Array, "d hq"]
    w_k: Float[Array, "d hkv"]
    w_v: Float[Array, "d hkv"]
    w_o: Float[Array, "hq d"]
    w_gate: Float[Array, "d heads"] | None  # zero init: gate 2·sigmoid(0) = 1
    qk_mult: Float[Array, " heads"] | None  # ablation: learnable per-head factor on top of config.qk_mult
    config: AttentionConfig = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)

    def __call__(
        self,
        a: Float[Array, "b s d"],
        segment_ids: Int[Array, "b s"],
        positions: Int[Array, "b s"],
        facts: LayerFacts,
        sconv_keys: ShortConv | None = None,
        sconv_values: ShortConv | None = None,
        impl: str = "xla",
        is_global: bool | None = None,
    ) -> Float[Array, "b s d"]:
        """`is_global`, when the caller knows the layer's kind statically, picks that kind's attention at
        trace time; None leaves the choice to a `lax.cond` on `facts.is_global`."""
        cfg, H, Dh = self.config, self.num_heads, self.head_dim
        B, S, _ = a.shape
        dtype = a.dtype
        q = linear(a, self.w_q.astype(dtype))
        k = linear(a, self.w_k.astype(dtype))
        v = linear(a, self.w_v.astype(dtype))
        if sconv_keys is not None:  # docs/recipe.md §2.1: on the key projection, before the QK norm
            k = sconv_keys(k, segment_ids)
        if sconv_values is not None:
            v = sconv_values(v, segment_ids)
        q = q.reshape(B, S, H, Dh)
        k = k.reshape(B, S, -1, Dh)
        v = v.reshape(B, S, -1, Dh)

        if cfg.qk_norm:  # non-parametric, per head over Dh, fp32
            q = rms_norm(q, cfg.qk_norm_eps)
            k = rms_norm(k, cfg.qk_norm_eps).astype(dtype)
        mult = jnp.full((H,), cfg.qk_mult, F32)
        if self.qk_mult is not None:
            mult = mult * self.qk_mult  # learnable ablation starts at the fixed value (param init 1)
        q = q.astype(F32) * mult[:, None]
        if is_global is None:
            q = q * jnp.where(facts.is_global, log_length_scale(positions), 1.0)[:, :, None, None]
        elif is_global:
            q = q * log_length_scale(positions)[:, :, None, None]
        q = q.astype(dtype)

        rotary_dims = int(Dh * cfg.rope_fraction)
        q = rope(q, positions, rotary_dims, cfg.rope_theta, facts.rope)
        k = rope(k, positions, rotary_dims, cfg.rope_theta, facts.rope)

        if impl == "xla":
            y = self._xla_attention(q, k, v, segment_ids, facts, is_global)
        else:  # cuDNN: each query head's KV head gathered (per-layer map), window and documents in the mask
            k = jnp.take(k, facts.kv_of_head, axis=2)
            v = jnp.take(v, facts.kv_of_head, axis=2)
            y = fused_attention(q, k, v, attention_mask(segment_ids, facts.window), impl)
            if cfg.xsa:
                y = exclusive_self_attention(y, v)
        if self.w_gate is not None:  # docs/recipe.md §2.7: head-wise gate after XSA, before W_o
            gate = 2.0 * jax.nn.sigmoid(linear(a, self.w_gate.astype(dtype)).astype(F32))
            y = (y.astype(F32) * gate[..., None]).astype(dtype)
        return linear(y.reshape(B, S, H * Dh), self.w_o.astype(dtype))

    def _xla_attention(
        self,
        q: Float[Array, "b s h d"],
        k: Float[Array, "b s kvs d"],
        v: Float[Array, "b s kvs d"],
        segment_ids: Int[Array, "b s"],
        facts: LayerFacts,
        is_global: bool | None = None,
    ) -> Float[Array, "b s h d"]:
        """Attention + XSA on the XLA path, each kind running only the work it needs: local layers the banded
        path over `config.window` with `local_kv_heads`, global layers the full square with the first
        `global_kv_heads` (docs/recipe.md §2.2). The kind is static when the caller knows it (the model scans
        runs of one kind), else a `lax.cond` on the traced fact. A cond inside a scanned, differentiated
        layer saves both branches' residuals — the global square included — in every layer, so the model
        avoids it. The traced `facts.window` is the mask's window; the band's static bound is
        `config.window`, which `Transformer.layer_facts` gives every local layer."""
        cfg = self.config

        def kind(kv_heads: int, max_window: int | None) -> Callable[..., Array]:
            def run(q: Array, k: Array, v: Array, segment_ids: Array, window: Array) -> Array:
                k, v = k[:, :, :kv_heads], v[:, :, :kv_heads]
                if max_window is None:
                    y = full_attention(q, k, v, segment_ids, window)
                else:
                    y = banded_attention(q, k, v, segment_ids, window, max_window)
                return exclusive_self_attention(y, v) if cfg.xsa else y

            return run

        local, global_ = kind(cfg.local_kv_heads, cfg.window), kind(cfg.global_kv_heads, None)
        if is_global is not None:
            return (global_ if is_global else local)(q, k, v, segment_ids, facts.window)
        return jax.lax.cond(facts.is_global, global_, local, q, k, v, segment_ids, facts.window)
