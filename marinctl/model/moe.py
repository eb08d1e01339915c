"""LatentMoE with shared experts and the quantile-balanced sigmoid router (docs/recipe.md §2, docs/recipe.md §3.1).

The router reads the full hidden state; routed experts run in a down-projected, RMS-normalized latent
(rows travel between devices at latent width, halving all-to-all bytes at 2× compression); two shared
SwiGLU experts read the full width. Which expert-parallel transport moves the rows is a recipe string
(`moe.transport`); every transport has the same signature (marinctl/routing/transports.py).
"""

# ruff: noqa: F722 (jaxtyping shape strings are not Python expressions)

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from marinctl.model.layers import F32, RMSNorm, linear
from marinctl.recipe import MoEConfig
from marinctl.routing.quantile_balance import quantile_beta, router_margins
from marinctl.routing.transports import get_transport

WEIGHT_SUM_EPS = 1e-9  # docs/recipe.md §2: w ← w · 2.5 / (Σ w + 1e-9)


class Routing(eqx.Module):
    """One routing decision for T tokens."""

    expert_idx: Int[Array, "t k"]  # selected on the biased scores
    combine: Float[Array, "t k"]  # from the unbiased sigmoid scores, renormalized to router_weight_sum
    margins: Float[Array, "t e"] | None  # QB input (docs/recipe.md §3.1), stop-gradient; None when K = E


def route(logits: Float[Array, "t e"], bias: Float[Array, " e"], moe: MoEConfig) -> Routing:
    """Top-K on biased scores, combine weights from the unbiased ones (recipe §2.10 steps 1–3, recipe §3.1).

    Selection and margins come from the routing team's `router_margins` ("logit": select on `s + b`,
    `μ = s − α`; "post_sigmoid": select on `sigmoid(s) + b`, `μ = sigmoid(s) − α`, α the (K+1)-th biased
    value). The bias only ever steers selection: `w = sigmoid(s_sel)`, renormalized to sum to 2.5.
    """
    K, E = moe.top_k, logits.shape[-1]
    if K < E:
        margins, expert_idx = router_margins(logits, bias.astype(F32), K, moe.qb_variant)
    else:  # every expert selected (only allowed without quantile balancing): no (K+1)-th value
        margins, expert_idx = None, jnp.broadcast_to(jnp.arange(E), logits.shape)
    w = jax.nn.sigmoid(jnp.take_along_axis(logits, expert_idx, axis=-1))
    combine = w * moe.router_weight_sum / (jnp.sum(w, axis=-1, keepdims=True) + WEIGHT_SUM_EPS)
    return Routing(expert_idx=expert_idx, combine=combine, margins=margins)


class Experts(eqx.Module):
    """E routed SwiGLU experts at latent width ℓ: `(silu(u W_g) ⊙ u W_u) W_d`, `[ℓ, I]` / `[I, ℓ]`."""

    w_gate: Float[Array, "e l i"]
    w_up: Float[Array, "e l i"]
    w_down: Float[Array, "e i l"]


class SharedExperts(eqx.Module):
    """n shared SwiGLU experts on the full-width input, summed (docs/recipe.md §2.10 step 7)."""

    w_gate: Float[Array, "n d i"]
    w_up: Float[Array, "n d i"]
    w_down: Float[Array, "n i d"]

    def __call__(self, m: Float[Array, "t d"]) -> Float[Array, "t d"]:
        dtype = m.dtype
        n, d, i = self.w_gate.shape  # the n experts side by side: one [d, n·i] and one [n·i, d] product each

        def wide(w: Array) -> Array:
            return jnp.swapaxes(w, 0, 1).reshape(d, n * i).astype(dtype)

        hidden = jax.nn.silu(linear(m, wide(self.w_gate))) * linear(m, wide(self.w_up))
        return linear(hidden, self.w_down.reshape(n * i, d).astype(dtype))


class LatentMoE(eqx.Module):
    """`routed = (Σ_k w_k · Expert_k(RMSNorm(m W_down))) W_up` plus the shared experts.

    With `moe.latent = False` the experts read and write the full width (no projections, no latent norm).
    Returns the layer's routing statistics (global sums over valid tokens) for the trainer.
    """

    router: Float[Array, "d e"]
    latent_down: Float[Array, "d l"] | None
    latent_norm: RMSNorm | None
    experts: Experts
    latent_up: Float[Array, "l d"] | None
    shared: SharedExperts | None
    config: MoEConfig = eqx.field(static=True)

    def __call__(
        self, m: Float[Array, "t d"], router_bias: Float[Array, " e"], valid: Bool[Array, " t"]
    ) -> tuple[Float[Array, "t d"], dict[str, Array]]:
        moe, dtype = self.config, m.dtype
        logits = linear(m.astype(F32), self.router)  # router in fp32 (docs/recipe.md §2.10 step 1)
        routing = route(logits, router_bias, moe)

        u = m
        if self.latent_down is not None:
            u = linear(m, self.latent_down.astype(dtype))
            if self.latent_norm is not None:
                u = self.latent_norm(u).astype(dtype)
        e = self.experts
        transport = get_transport(moe.transport)
        y, stats = transport(
            u,
            routing.expert_idx,
            routing.combine,
            valid,
            e.w_gate.astype(dtype),
            e.w_up.astype(dtype),
            e.w_down.astype(dtype),
            moe,
        )
        out = y.astype(dtype)
        if self.latent_up is not None:
            out = linear(out, self.latent_up.astype(dtype))
        if self.shared is not None:
            out = out + self.shared(m)

        stats = dict(stats)
        stats["beta"] = self._beta(routing, valid, logits.shape[-1])
        lse = jax.nn.logsumexp(logits, axis=-1)
        n_valid = jnp.maximum(jnp.sum(valid), 1)
        stats["router_z"] = jnp.sum(jnp.where(valid, lse * lse, 0.0)) / n_valid  # logged, never added
        return out, stats

    def _beta(self, routing: Routing, valid: Bool[Array, " t"], num_experts: int) -> Float[Array, " e"]:
        """This step's QB quantile (docs/recipe.md §3). Computed with `balancing = "none"` too, for logging — the
        trainer then ignores it; zeros when K = E (every expert always selected, nothing to balance)."""
        if routing.margins is None:
            return jnp.zeros((num_experts,), F32)
        moe = self.config
        return quantile_beta(routing.margins, valid, moe.top_k, estimator=moe.qb_estimator, n_bins=moe.qb_bins)
