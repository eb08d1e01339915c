"""Quantile balancing (docs/recipe.md §3): a router bias that makes every expert receive N·K/E assignments.

Each step, per layer, the model computes routing margins `μ[t,e] = s[t,e] − α_t` (unbiased logit minus
the biased (K+1)-th value, stop-gradient). An expert's quantile β_e is the margin above which exactly its
fair share `N_valid·K/E` of tokens lie; next step the bias is *replaced* by `b = −(β − mean β)`, so the
bias is a function of the last batch, not an optimizer parameter (no auxiliary loss, no gradient).

The estimator is a live-range histogram: 10,000 bins spanning [min μ, max μ] of the whole global batch,
per-expert counts summed across shards, and linear interpolation inside the bin that holds the quantile.
Counts add across shards and min/max combine exactly, so the result does not depend on how the batch
is split (`quantile_beta_sharded` proves it with explicit pmin/pmax/psum inside `shard_map`; the
global-view `quantile_beta` gets the same reductions from jit). `exact` sorts, for tests and ablations.

The metrics helpers at the bottom turn the per-expert load into the numbers the trainer logs
(docs/recipe.md §3, 10): routing entropy (ln E is perfectly uniform), max/mean load, and drop fraction.
"""

# ruff: noqa: F722 (jaxtyping shape strings are not Python expressions)

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

Estimator = Literal["histogram", "exact"]
AxisName = str | Sequence[str]

_LIVE_RANGE_FLOOR = 1e-6  # docs/recipe.md §3.2: hi = max(max μ, lo + 1e-6) so an all-equal batch still has a width


def quantile_beta(
    margins: Float[Array, "T E"],
    valid: Bool[Array, " T"],
    top_k: int,
    *,
    estimator: Estimator = "histogram",
    n_bins: int = 10000,
) -> Float[Array, " E"]:
    """β_e: the margin above which expert e's fair share N_valid·K/E of valid tokens lie (docs/recipe.md §3).

    Global-view arrays: under jit on a mesh the min/max/sum reductions are global, so the result is the
    same for any device count. Padding tokens (`valid` False) neither count nor move the live range.
    """
    if estimator == "exact":
        return _exact_beta(margins, valid, top_k)
    if estimator != "histogram":
        raise ValueError(f"unknown quantile estimator {estimator!r} (histogram | exact)")
    return _histogram_beta(margins, valid, top_k, n_bins, _identity, _identity, _identity)


def quantile_beta_sharded(
    margins: Float[Array, "T E"],
    valid: Bool[Array, " T"],
    top_k: int,
    *,
    axis_name: AxisName,
    estimator: Estimator = "histogram",
    n_bins: int = 10000,
) -> Float[Array, " E"]:
    """`quantile_beta` on this shard's tokens inside `shard_map`, reduced over `axis_name` explicitly.

    The live range is pmin/pmax'd and the integer histogram psum'd, so every shard returns the
    identical β, bit for bit the value one device would compute on the concatenated batch.
    """
    if estimator == "exact":
        gather = lambda x: jax.lax.all_gather(x, axis_name, axis=0, tiled=True)  # noqa: E731
        return _exact_beta(gather(margins), gather(valid), top_k)
    if estimator != "histogram":
        raise ValueError(f"unknown quantile estimator {estimator!r} (histogram | exact)")
    return _histogram_beta(
        margins,
        valid,
        top_k,
        n_bins,
        lambda x: jax.lax.pmin(x, axis_name),
        lambda x: jax.lax.pmax(x, axis_name),
        lambda x: jax.lax.psum(x, axis_name),
    )


def router_bias(beta: Float[Array, "... E"]) -> Float[Array, "... E"]:
    """Next step's router bias, replacing the old one: `b = −(β − mean_e β)` (docs/recipe.md §3.5). Works per layer."""
    return -(beta - jnp.mean(beta, axis=-1, keepdims=True))


# Up to this many experts `top_k_rows` ranks by comparison on CPU: 2.6-7.6x faster than `lax.top_k` at 16-32
# experts, even at 48, ~6x slower at 64 in a prototype (the E² compares per token; bench/README.md, stop 42).
RANK_TOP_K_MAX_EXPERTS = 32


def top_k_rows(x: Float[Array, "T E"], k: int) -> tuple[Float[Array, "T k"], Int[Array, "T k"]]:
    """`jax.lax.top_k(x, k)`, equal bit for bit: descending in float total order (+0 above −0, NaN at the
    ends by sign), equal keys in index order.

    XLA:CPU lowers `top_k` to a comparator sort of every row: 1.9 ms per layer in the tiny step's profile.
    On CPU with few experts, each entry's rank is instead counted from all E² pairwise comparisons of
    total-order integer keys (the entries ahead of it: a greater key, or an equal one at a lower index),
    which is a permutation of 0..E−1, and the first k ranks are read off one-hot.
    """
    n = x.shape[-1]
    if jax.default_backend() != "cpu" or n > RANK_TOP_K_MAX_EXPERTS or x.dtype != jnp.float32:
        return jax.lax.top_k(x, k)
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    key = jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)  # integer order = float total order
    experts = jnp.arange(n)
    mine, other = key[..., :, None], key[..., None, :]  # [T, e, e']
    ahead = (other > mine) | ((other == mine) & (experts[None, :] < experts[:, None]))
    rank = jnp.sum(ahead, axis=-1, dtype=jnp.int32)  # [T, e]
    at = rank[..., :, None] == jnp.arange(k)  # [T, e, k]: exactly one e per k
    idx = jnp.sum(jnp.where(at, experts[:, None], 0), axis=-2)
    return jnp.take_along_axis(x, idx, axis=-1), idx


def router_margins(
    logits: Float[Array, "T E"],
    bias: Float[Array, " E"],
    top_k: int,
    variant: Literal["logit", "post_sigmoid"] = "logit",
) -> tuple[Float[Array, "T E"], Int[Array, "T K"]]:
    """Selected experts and QB margins for one layer (recipe §2.10 steps 1-2, recipe §3.1), stop-gradient.

    "logit" (the hero): select on `s + b`, α_t the (K+1)-th biased value, `μ = s − α`.
    "post_sigmoid" (DeepSeek-V3 / Kimi ablation): select on `sigmoid(s) + b`, `μ = sigmoid(s) − α`.
    Combine weights are the model's business (they come from the unbiased logits of the selection).
    """
    scores = jax.nn.sigmoid(logits) if variant == "post_sigmoid" else logits
    scores = jax.lax.stop_gradient(scores.astype(jnp.float32))
    biased = scores + jax.lax.stop_gradient(bias)
    top_values, top_idx = top_k_rows(biased, top_k + 1)
    alpha = top_values[:, top_k]
    return scores - alpha[:, None], top_idx[:, :top_k]


# --------------------------------------------------------------------------------------------------
# Estimators


def _identity(x):
    return x


def _fair_share(n_valid: Int[Array, ""], top_k: int, n_experts: int) -> tuple[Int[Array, ""], Float[Array, ""]]:
    """ceil(N·K/E) as an integer and its excess over N·K/E, in integer arithmetic (exact at hero scale,
    where N·K/E ≈ 1e6 and float32 would round the count a cumulative histogram is compared with)."""
    total = n_valid * top_k
    share = (total + n_experts - 1) // n_experts
    excess = (share * n_experts - total).astype(jnp.float32) / n_experts
    return share, excess


def _histogram_beta(
    margins: Float[Array, "T E"],
    valid: Bool[Array, " T"],
    top_k: int,
    n_bins: int,
    reduce_min: Callable,
    reduce_max: Callable,
    reduce_sum: Callable,
) -> Float[Array, " E"]:
    margins = jax.lax.stop_gradient(margins).astype(jnp.float32)
    n_experts = margins.shape[1]
    v = valid[:, None]
    # docs/recipe.md §3.2: the live range of this batch; no fixed bound on the logits is assumed.
    lo = reduce_min(jnp.min(jnp.where(v, margins, jnp.inf)))
    hi = reduce_max(jnp.max(jnp.where(v, margins, -jnp.inf)))
    lo = jnp.where(jnp.isfinite(lo), lo, 0.0)  # no valid token anywhere: any finite β will do
    hi = jnp.maximum(jnp.where(jnp.isfinite(hi), hi, 0.0), lo + _LIVE_RANGE_FLOOR)
    width = (hi - lo) / n_bins
    # docs/recipe.md §3.3: one histogram row per expert, integer counts so psum over shards is exact.
    bins = jnp.clip(jnp.floor((margins - lo) / width), 0, n_bins - 1).astype(jnp.int32)
    flat = jnp.arange(n_experts, dtype=jnp.int32)[None, :] * n_bins + bins
    count = jax.ops.segment_sum(
        jnp.broadcast_to(v, margins.shape).astype(jnp.int32).reshape(-1),
        flat.reshape(-1),
        num_segments=n_experts * n_bins,
    ).reshape(n_experts, n_bins)
    count = reduce_sum(count)
    n_valid = reduce_sum(jnp.sum(valid.astype(jnp.int32)))
    # docs/recipe.md §3.4: cum[e,b] = #margins in bins >= b; b* is the last bin still holding the fair share.
    share, excess = _fair_share(n_valid, top_k, n_experts)
    cum = jnp.flip(jnp.cumsum(jnp.flip(count, axis=1), axis=1), axis=1)
    b_star = jnp.clip(jnp.sum(cum >= share, axis=1) - 1, 0, n_bins - 1)
    cum_star = jnp.take_along_axis(cum, b_star[:, None], axis=1)[:, 0]
    count_star = jnp.take_along_axis(count, b_star[:, None], axis=1)[:, 0]
    # (cum − target) with target = share − excess, split so the large integers subtract exactly.
    above_target = (cum_star - share).astype(jnp.float32) + excess
    in_bin = above_target / jnp.maximum(count_star, 1).astype(jnp.float32)
    return lo + b_star.astype(jnp.float32) * width + width * in_bin


def _exact_beta(margins: Float[Array, "T E"], valid: Bool[Array, " T"], top_k: int) -> Float[Array, " E"]:
    """The ceil(N·K/E)-th largest valid margin of each expert: the value the histogram interpolates
    towards (it lies in bin b*, so the histogram estimate is within one bin width of it)."""
    margins = jax.lax.stop_gradient(margins).astype(jnp.float32)
    n_tokens, n_experts = margins.shape
    ordered = -jnp.sort(-jnp.where(valid[:, None], margins, -jnp.inf), axis=0)  # descending per expert
    n_valid = jnp.sum(valid.astype(jnp.int32))
    share, _ = _fair_share(n_valid, top_k, n_experts)
    row = jnp.clip(share - 1, 0, n_tokens - 1)
    beta = jax.lax.dynamic_index_in_dim(ordered, row, axis=0, keepdims=False)
    return jnp.where(jnp.isfinite(beta), beta, 0.0)


# --------------------------------------------------------------------------------------------------
# Metrics (docs/recipe.md §3, 10): what the trainer logs per layer. Inputs are the transports' global stats.


def routing_entropy(expert_load: Float[Array, "... E"]) -> Float[Array, "..."]:
    """Entropy (nats) of the per-expert share of assignments; ln E means perfectly uniform routing."""
    load = expert_load.astype(jnp.float32)
    p = load / jnp.maximum(jnp.sum(load, axis=-1, keepdims=True), 1e-30)
    return -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)


def max_mean_load(expert_load: Float[Array, "... E"]) -> Float[Array, "..."]:
    """Busiest expert's load over the mean load (1 is perfect balance; what sizes the buffers)."""
    load = expert_load.astype(jnp.float32)
    return jnp.max(load, axis=-1) / jnp.maximum(jnp.mean(load, axis=-1), 1e-30)


def drop_fraction(
    sender_drops: Float[Array, "..."], receiver_drops: Float[Array, "..."], assignments: Float[Array, "..."]
) -> Float[Array, "..."]:
    """Share of valid assignments that were not computed (sender pool or receiver buffer overflow)."""
    dropped = jnp.asarray(sender_drops, jnp.float32) + jnp.asarray(receiver_drops, jnp.float32)
    return dropped / jnp.maximum(jnp.asarray(assignments, jnp.float32), 1.0)


def routing_metrics(stats: dict[str, Array]) -> dict[str, Array]:
    """{routing_entropy, max_mean_load, drop_fraction, sender_drop_fraction, receiver_drop_fraction}
    from a transport's stats dict (per layer when the stats carry a leading L axis)."""
    a = stats["assignments"]
    return {
        "routing_entropy": routing_entropy(stats["expert_load"]),
        "max_mean_load": max_mean_load(stats["expert_load"]),
        "drop_fraction": drop_fraction(stats["sender_drops"], stats["receiver_drops"], a),
        "sender_drop_fraction": drop_fraction(stats["sender_drops"], 0.0, a),
        "receiver_drop_fraction": drop_fraction(0.0, stats["receiver_drops"], a),
    }
