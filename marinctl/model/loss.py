"""The training loss (SPEC 2): mean token cross-entropy plus the logit z-loss, over unmasked tokens.

The z-loss `w · logsumexp(logits)²` stays in the recipe because hyperball pins the lm_head norm but
not the final RMSNorm gain, which otherwise grows and inflates the logits (the run's lesson, SPEC 10).
"""

# ruff: noqa: F722 (jaxtyping shape strings are not Python expressions)

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from marinctl.model.transformer import Transformer
from marinctl.recipe import Recipe


def lm_loss(
    logits: Float[Array, "b s v"],
    targets: Int[Array, "b s"],
    loss_mask: Float[Array, "b s"],
    z_loss_weight: float,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """`(ce + z_loss, {"ce", "z_loss"})`, both means over tokens with `loss_mask` = 1; `loss = ce + z_loss`.

    The logsumexp is computed once, in fp32, and serves both terms. Targets under a zero mask may hold
    anything (a -1 pad id included): they are clipped into range so they can never turn the loss NaN.
    """
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    safe_targets = jnp.clip(targets, 0, logits.shape[-1] - 1)
    target_logit = jnp.take_along_axis(logits, safe_targets[..., None], axis=-1)[..., 0]
    mask = loss_mask.astype(jnp.float32)
    n_tokens = jnp.maximum(jnp.sum(mask), 1.0)
    ce = jnp.sum((lse - target_logit) * mask) / n_tokens
    z_loss = z_loss_weight * jnp.sum(lse * lse * mask) / n_tokens
    return ce + z_loss, {"ce": ce, "z_loss": z_loss}


def model_loss(
    model: Transformer, batch: dict[str, Array], router_bias: Float[Array, "layers e"], recipe: Recipe
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Forward + loss on a packed batch {tokens, targets, segment_ids, loss_mask} ([B,S] each).

    aux = {"ce", "z_loss"} plus the model's per-layer MoE statistics ([L]-stacked: beta, expert_load,
    assignments, sender_drops, receiver_drops, router_z).
    """
    logits, stats = model(batch["tokens"], batch["segment_ids"], router_bias)
    loss, parts = lm_loss(logits, batch["targets"], batch["loss_mask"], recipe.model.z_loss_weight)
    return loss, {**stats, **parts}
