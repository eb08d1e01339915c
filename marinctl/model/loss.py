"""The training loss (docs/recipe.md §2): mean token cross-entropy plus the logit z-loss, over unmasked tokens.

The z-loss `w · logsumexp(logits)²` stays in the recipe because hyperball pins the lm_head norm but
not the final RMSNorm gain, which otherwise grows and inflates the logits (the run's lesson, docs/recipe.md §10).

`model.ce_chunk_tokens` > 0 applies the lm_head and the loss one token chunk at a time under a scan with
a rematerialized body, so only one chunk's fp32 logits (and their gradient) is ever alive: the hero's
full [tokens, V] logits and gradient are ~67 GB per GPU, one 8,192-token chunk ~8 GB.
"""

# ruff: noqa: F722 (jaxtyping shape strings are not Python expressions)

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from marinctl.model.layers import F32, batch_shards
from marinctl.model.transformer import Transformer
from marinctl.recipe import Recipe


def _loss_sums(
    logits: Float[Array, "... v"], targets: Int[Array, "..."], mask: Float[Array, "..."]
) -> Float[Array, " 2"]:
    """[Σ mask·(lse − target logit), Σ mask·lse²]. The logsumexp is computed once, in fp32, and serves both
    terms. Targets under a zero mask may hold anything (a -1 pad id included): they are clipped into range
    so they can never turn the loss NaN."""
    logits = logits.astype(F32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    safe_targets = jnp.clip(targets, 0, logits.shape[-1] - 1)
    target_logit = jnp.take_along_axis(logits, safe_targets[..., None], axis=-1)[..., 0]
    mask = mask.astype(F32)
    return jnp.stack([jnp.sum((lse - target_logit) * mask), jnp.sum(lse * lse * mask)])


def _finish(sums: Float[Array, " 2"], loss_mask: Array, z_loss_weight: float) -> tuple[Array, dict[str, Array]]:
    n_tokens = jnp.maximum(jnp.sum(loss_mask.astype(F32)), 1.0)
    ce = sums[0] / n_tokens
    z_loss = z_loss_weight * sums[1] / n_tokens
    return ce + z_loss, {"ce": ce, "z_loss": z_loss}


def lm_loss(
    logits: Float[Array, "b s v"],
    targets: Int[Array, "b s"],
    loss_mask: Float[Array, "b s"],
    z_loss_weight: float,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """`(ce + z_loss, {"ce", "z_loss"})`, both means over tokens with `loss_mask` = 1; `loss = ce + z_loss`."""
    return _finish(_loss_sums(logits, targets, loss_mask), loss_mask, z_loss_weight)


def chunk_length(batch: int, seq: int, chunk_tokens: int) -> int:
    """Sequence positions per chunk: `chunk_tokens` tokens on each device, whose share of the batch is
    `batch / batch_shards(batch)` rows (the batch dim stays sharded; chunks cut the sequence). 0 = all."""
    if chunk_tokens <= 0:
        return seq
    rows = batch // batch_shards(batch)
    return max(1, min(seq, chunk_tokens // rows))


def chunked_lm_loss(
    h: Float[Array, "b s d"],
    lm_head: Float[Array, "d v"],
    targets: Int[Array, "b s"],
    loss_mask: Float[Array, "b s"],
    z_loss_weight: float,
    chunk_tokens: int,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """`lm_loss(h @ lm_head, ...)` computed over sequence chunks of `chunk_length` positions.

    A `lax.scan` over chunks accumulates the two loss sums; its body is `jax.checkpoint`ed, so the forward
    keeps no logits and the backward recomputes one chunk's logits, takes their gradient and folds it into
    dh (that chunk) and dW (the scan's accumulated cotangent) before moving on. A ragged last chunk is
    padded with zero-mask positions. One chunk is a plain (non-remat) lm_head + loss.
    """
    B, S, _ = h.shape
    c = chunk_length(B, S, chunk_tokens)
    w = lm_head.astype(h.dtype)
    if c >= S:
        logits = jnp.einsum("bsd,dv->bsv", h, w, preferred_element_type=F32)
        return lm_loss(logits, targets, loss_mask, z_loss_weight)
    n = -(-S // c)
    pad = n * c - S
    if pad:  # zero-mask positions: they add 0 to both sums and receive a zero gradient
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        targets = jnp.pad(targets, ((0, 0), (0, pad)))
        mask = jnp.pad(loss_mask, ((0, 0), (0, pad)))
    else:
        mask = loss_mask

    def chunks(x: Array) -> Array:  # [B, n·c, ...] -> [n, B, c, ...]: the batch dim keeps its sharding
        return jnp.swapaxes(x.reshape(B, n, c, *x.shape[2:]), 0, 1)

    @jax.checkpoint
    def body(sums: Array, xs: tuple[Array, Array, Array]) -> tuple[Array, None]:
        hc, tc, mc = xs
        logits = jnp.einsum("bcd,dv->bcv", hc, w, preferred_element_type=F32)
        return sums + _loss_sums(logits, tc, mc), None

    sums, _ = jax.lax.scan(body, jnp.zeros(2, F32), (chunks(h), chunks(targets), chunks(mask)))
    return _finish(sums, loss_mask, z_loss_weight)


def model_loss(
    model: Transformer, batch: dict[str, Array], router_bias: Float[Array, "layers e"], recipe: Recipe
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Forward + loss on a packed batch {tokens, targets, segment_ids, loss_mask} ([B,S] each).

    aux = {"ce", "z_loss"} plus the model's per-layer MoE statistics ([L]-stacked: beta, expert_load,
    assignments, sender_drops, receiver_drops, router_z).
    """
    h, stats = model.features(batch["tokens"], batch["segment_ids"], router_bias)
    loss, parts = chunked_lm_loss(
        h,
        model.lm_head.weight,
        batch["targets"],
        batch["loss_mask"],
        recipe.model.z_loss_weight,
        recipe.model.ce_chunk_tokens,
    )
    return loss, {**stats, **parts}
