"""Quantile balancing (docs/recipe.md §3) against numpy oracles; device-count independence; convergence."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

from marinctl.routing.quantile_balance import (
    drop_fraction,
    max_mean_load,
    quantile_beta,
    quantile_beta_sharded,
    router_bias,
    router_margins,
    routing_entropy,
    routing_metrics,
    top_k_rows,
)

E, K = 16, 4


def margins_batch(seed: int, tokens: int = 1024):
    """Margins with per-expert offsets and scales (a skewed router) and ~15% padding rows."""
    rng = np.random.default_rng(seed)
    margins = rng.normal(size=(tokens, E)) * rng.uniform(0.5, 2.0, E) + rng.uniform(-2, 2, E)
    valid = rng.random(tokens) > 0.15
    margins[~valid] = 1e3  # padding must not move the live range or the counts
    return margins.astype(np.float32), valid


def numpy_exact(margins, valid, top_k):
    """The ceil(N·K/E)-th largest valid margin per expert."""
    m = margins[valid].astype(np.float64)
    share = math.ceil(m.shape[0] * top_k / m.shape[1])
    return -np.sort(-m, axis=0)[share - 1]


def numpy_histogram(margins, valid, top_k, n_bins):
    """docs/recipe.md §3 steps 2-4, transcribed literally in float64."""
    m = margins[valid].astype(np.float64)
    lo = m.min()
    hi = max(m.max(), lo + 1e-6)
    w = (hi - lo) / n_bins
    bins = np.clip(np.floor((m - lo) / w), 0, n_bins - 1).astype(int)
    count = np.stack([np.bincount(bins[:, e], minlength=n_bins) for e in range(m.shape[1])])
    target = m.shape[0] * top_k / m.shape[1]
    cum = np.cumsum(count[:, ::-1], axis=1)[:, ::-1]
    b_star = np.clip((cum >= target).sum(axis=1) - 1, 0, n_bins - 1)
    rows = np.arange(m.shape[1])
    return lo + b_star * w + w * (cum[rows, b_star] - target) / np.maximum(count[rows, b_star], 1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_estimator_is_the_fair_share_quantile(seed):
    margins, valid = margins_batch(seed)
    got = quantile_beta(margins, valid, K, estimator="exact")
    np.testing.assert_allclose(got, numpy_exact(margins, valid, K), rtol=0, atol=1e-6)


@pytest.mark.parametrize("n_bins", [100, 10000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_histogram_estimator_is_within_one_bin_of_exact_and_follows_spec_formula(seed, n_bins):
    margins, valid = margins_batch(seed)
    got = np.asarray(quantile_beta(margins, valid, K, n_bins=n_bins))
    live = margins[valid]
    bin_width = (live.max() - live.min()) / n_bins
    assert np.all(np.abs(got - numpy_exact(margins, valid, K)) <= bin_width * 1.0001)
    np.testing.assert_allclose(got, numpy_histogram(margins, valid, K, n_bins), rtol=0, atol=bin_width * 1e-3)


def test_padding_tokens_do_not_change_beta():
    margins, valid = margins_batch(3)
    assert np.any(~valid)
    without = quantile_beta(margins[valid], np.ones(valid.sum(), bool), K)
    np.testing.assert_array_equal(quantile_beta(margins, valid, K), without)


@pytest.mark.parametrize("estimator", ["histogram", "exact"])
def test_bias_is_identical_for_1_2_4_8_data_shards_over_one_global_batch(estimator):
    margins, valid = margins_batch(4, tokens=512)
    biases = []
    for shards in (1, 2, 4, 8):
        mesh = jax.make_mesh((shards,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:shards])

        def per_shard(m, v):
            beta = quantile_beta_sharded(m, v, K, axis_name="data", estimator=estimator)
            return router_bias(beta)[None]

        spec = PartitionSpec("data")
        f = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
        every_shard = np.asarray(f(margins, valid))
        assert np.all(every_shard == every_shard[0])  # all shards agree
        biases.append(every_shard[0])
    for bias in biases[1:]:
        np.testing.assert_array_equal(bias, biases[0])  # bit for bit, whatever the split
    # The global-view function is a different XLA program (other fusions), so equal to float rounding only.
    global_view = router_bias(quantile_beta(margins, valid, K, estimator=estimator))
    np.testing.assert_allclose(biases[0], global_view, rtol=0, atol=1e-5)


def test_router_bias_replaces_with_minus_centred_beta():
    beta = np.array([[0.5, 1.5, -1.0, 3.0], [2.0, 2.0, 2.0, 2.0]], np.float32)
    np.testing.assert_allclose(router_bias(beta), -(beta - beta.mean(axis=1, keepdims=True)), atol=1e-7)


@pytest.mark.parametrize("variant", ["logit", "post_sigmoid"])
def test_router_margins_select_on_biased_scores_and_measure_from_the_k_plus_1th(variant):
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(64, E)).astype(np.float32)
    bias = rng.normal(size=E).astype(np.float32)
    margins, idx = router_margins(logits, bias, K, variant)
    scores = 1 / (1 + np.exp(-logits.astype(np.float64))) if variant == "post_sigmoid" else logits
    biased = scores + bias
    order = np.argsort(-biased, axis=1)
    np.testing.assert_array_equal(np.sort(idx, axis=1), np.sort(order[:, :K], axis=1))
    alpha = np.take_along_axis(biased, order[:, K : K + 1], axis=1)
    np.testing.assert_allclose(margins, scores - alpha, atol=1e-6)


def top_k_cases():
    """Rows that order every way a float can: ±0, ±inf, NaN of both signs, heavy ties, all-equal rows."""
    rng = np.random.default_rng(9)
    nan = np.float32(np.nan)
    odd = [0.0, -0.0, 0.0, -0.0, 1.0, -1.0, np.inf, -np.inf, nan, -nan, 1.0, -0.0, 3, 3, -np.inf, nan]
    yield np.asarray([odd, odd[::-1]], np.float32)
    yield rng.standard_normal((1024, 16)).astype(np.float32)
    yield rng.integers(-2, 3, (256, 32)).astype(np.float32)  # ties everywhere
    yield np.zeros((8, 8), np.float32) * np.where(rng.random((8, 8)) < 0.5, -1, 1).astype(np.float32)


@pytest.mark.parametrize("case", list(top_k_cases()), ids=["ieee", "normal", "ties", "signed_zeros"])
def test_top_k_rows_equals_lax_top_k_bit_for_bit(case):
    for k in (1, 5, case.shape[1]):
        want_values, want_idx = jax.lax.top_k(jnp.asarray(case), k)
        values, idx = jax.jit(top_k_rows, static_argnums=1)(jnp.asarray(case), k)
        np.testing.assert_array_equal(idx, want_idx)
        np.testing.assert_array_equal(np.asarray(values).view(np.int32), np.asarray(want_values).view(np.int32))


def test_top_k_rows_ranks_on_cpu_only_up_to_its_expert_limit():
    """The comparison path replaces XLA's sort where it is faster (here: CPU, ≤ 32 experts)."""

    def primitives(n):
        jaxpr = jax.make_jaxpr(lambda x: top_k_rows(x, 3))(jnp.zeros((4, n), jnp.float32))
        return {eqn.primitive.name for eqn in jaxpr.jaxpr.eqns}

    assert jax.default_backend() == "cpu"
    assert "top_k" not in primitives(16) and "top_k" not in primitives(32)
    assert "top_k" in primitives(64)


def test_quantile_balancing_brings_a_skewed_router_to_uniform_load_and_cuts_drops():
    """Fixed router with a biased init (expert e's logit +3e/(E-1)); each step fresh tokens from the same
    distribution, routed with the bias QB set from the previous step's batch. Without the update the
    load stays skewed, so this test fails if the bias does nothing."""
    tokens, hidden, steps, cf = 1024, 32, 30, 1.25
    rng = np.random.default_rng(6)
    router = jnp.asarray(rng.normal(size=(hidden, E)) / math.sqrt(hidden), jnp.float32)
    skew = jnp.linspace(0.0, 3.0, E)
    cap = math.ceil(cf * tokens * K / E)  # the fixed transport's cell on one shard (docs/recipe.md §4)

    def step(bias, key, update: bool):
        x_key, v_key = jax.random.split(key)
        logits = jax.random.normal(x_key, (tokens, hidden)) @ router + skew
        valid = jax.random.uniform(v_key, (tokens,)) > 0.1
        margins, idx = router_margins(logits, bias, K)
        load = jnp.zeros(E).at[idx.reshape(-1)].add(jnp.repeat(valid, K).astype(jnp.float32))
        drops = jnp.sum(jnp.maximum(load - cap, 0.0)) / jnp.sum(load)
        new_bias = router_bias(quantile_beta(margins, valid, K)) if update else bias
        return new_bias, (routing_entropy(load), drops)

    keys = jax.random.split(jax.random.key(0), steps)
    uniform = math.log(E)
    results = {}
    for update in (True, False):
        run = jax.jit(
            lambda bias, ks, u=update: jax.lax.scan(lambda b, k: step(b, k, u), bias, ks)[1],
            compiler_options={"xla_backend_optimization_level": 0},
        )  # compile time dominates
        entropy, drops = run(jnp.zeros(E), keys)
        results[update] = (np.asarray(entropy), np.asarray(drops))
    entropy, drops = results[True]
    assert entropy[0] < 0.9 * uniform and drops[0] > 0.2  # the skew is real
    assert np.all(entropy[-10:] > 0.99 * uniform)
    assert drops[-10:].max() < 0.1 * drops[0]
    frozen_entropy, frozen_drops = results[False]
    assert frozen_entropy[-10:].max() < 0.95 * uniform and frozen_drops[-10:].min() > 0.2


def test_routing_metrics_against_numpy():
    load = np.array([[10, 10, 10, 10], [40, 0, 0, 0], [4, 2, 1, 1]], np.float32)
    p = load / load.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.nansum(np.where(p > 0, p * np.log(p), 0), axis=1)
    np.testing.assert_allclose(routing_entropy(load), entropy, atol=1e-6)
    np.testing.assert_allclose(routing_entropy(load)[0], math.log(4), atol=1e-6)
    np.testing.assert_allclose(max_mean_load(load), load.max(axis=1) / load.mean(axis=1), atol=1e-6)
    np.testing.assert_allclose(drop_fraction(3.0, 1.0, 40.0), 0.1, atol=1e-7)
    metrics = routing_metrics(
        {"expert_load": load, "assignments": load.sum(1), "sender_drops": [2, 0, 1], "receiver_drops": [2, 4, 0]}
    )
    np.testing.assert_allclose(metrics["drop_fraction"], [0.1, 0.1, 0.125], atol=1e-7)
    np.testing.assert_allclose(metrics["sender_drop_fraction"], [0.05, 0.0, 0.125], atol=1e-7)
