"""RMSNorm, GatedNorm and SConv against plain numpy."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from marinctl.model.layers import GatedNorm, RMSNorm, ShortConv, linear, normalize, rms_norm, shard_batch
from marinctl.recipe import ParallelConfig
from marinctl.routing.mesh import make_mesh

RNG = np.random.default_rng(0)


def np_rms(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def np_silu(x):
    return x / (1 + np.exp(-x))


def np_sigmoid(x):
    return 1 / (1 + np.exp(-x))


def test_linear_gives_the_product_and_autodiffs_gradients_for_any_leading_axes():
    """`linear` only moves where XLA fuses its backward: value and both gradients equal plain `x @ w`'s."""
    w = jnp.asarray(RNG.normal(size=(16, 8)).astype(np.float32))
    for shape in [(5, 16), (2, 3, 16)]:
        x = jnp.asarray(RNG.normal(size=shape).astype(np.float32))

        def loss(f, x, w):  # a nonlinear consumer, as the norms and gates downstream of every projection
            return jnp.sum(jnp.tanh(f(x, w)) * jnp.arange(8.0))

        ours = jax.jit(jax.value_and_grad(lambda x, w: loss(linear, x, w), argnums=(0, 1)))(x, w)
        ref = jax.jit(jax.value_and_grad(lambda x, w: loss(jnp.matmul, x, w), argnums=(0, 1)))(x, w)
        np.testing.assert_allclose(np.asarray(linear(x, w)), np.asarray(x) @ np.asarray(w), rtol=1e-5, atol=1e-5)
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref), strict=True):
            assert a.shape == b.shape
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_rms_norm_with_gain_matches_numpy_in_fp32():
    x = RNG.normal(size=(3, 5, 16)).astype(np.float32) * 4
    gain = RNG.normal(size=(16,)).astype(np.float32)
    out = RMSNorm(jnp.asarray(gain), eps=1e-5)(jnp.asarray(x, jnp.bfloat16))
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), np_rms(x, 1e-5) * gain, rtol=1e-2, atol=1e-2)  # bf16 input
    np.testing.assert_allclose(np.asarray(rms_norm(jnp.asarray(x), 1e-5)), np_rms(x, 1e-5), rtol=1e-5, atol=1e-6)


def test_gated_norm_matches_numpy_and_gates_at_one_half_at_init():
    d, r = 16, 4
    x_hat = np_rms(RNG.normal(size=(6, d)), 1e-5).astype(np.float32)
    w_down = RNG.normal(size=(d, r)).astype(np.float32) * 0.3
    w_up = RNG.normal(size=(r, d)).astype(np.float32) * 0.3
    out = GatedNorm(jnp.asarray(w_down), jnp.asarray(w_up))(jnp.asarray(x_hat), jnp.float32)
    expected = x_hat * np_sigmoid(np_silu(x_hat @ w_down) @ w_up)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)

    d, r = 512, 16  # at the recipe's init scale 0.5/√D the gate starts near 0.5 (the hero's r/D is smaller)
    x_hat = np_rms(RNG.normal(size=(6, d)), 1e-5).astype(np.float32)
    std = 0.5 / np.sqrt(d)
    w_down, w_up = (std * np.clip(RNG.normal(size=s), -3, 3).astype(np.float32) for s in ((d, r), (r, d)))
    gate = np.asarray(GatedNorm(jnp.asarray(w_down), jnp.asarray(w_up))(jnp.asarray(x_hat), jnp.float32)) / x_hat
    np.testing.assert_allclose(gate, 0.5, atol=0.03)


def test_normalize_applies_rms_then_gated_norm_and_casts_to_compute_dtype():
    d = 8
    x = RNG.normal(size=(2, 3, d)).astype(np.float32)
    gain = RNG.normal(size=(d,)).astype(np.float32)
    w_down, w_up = RNG.normal(size=(d, 2)).astype(np.float32), RNG.normal(size=(2, d)).astype(np.float32)
    out = normalize(
        RMSNorm(jnp.asarray(gain), 1e-5),
        GatedNorm(jnp.asarray(w_down), jnp.asarray(w_up)),
        jnp.asarray(x),
        jnp.bfloat16,
    )
    assert out.dtype == jnp.bfloat16
    x_hat = np_rms(x, 1e-5) * gain
    expected = x_hat * np_sigmoid(np_silu(x_hat @ w_down) @ w_up)
    np.testing.assert_allclose(np.asarray(out, np.float32), expected, rtol=3e-2, atol=3e-2)


def naive_sconv(x, w, seg):
    """out[b,t,c] = Σ_lag w[lag,c] · x[b,t−lag,c] · 1[seg(t−lag) = seg(t)], zero before the start."""
    B, S, _ = x.shape
    out = np.zeros_like(x)
    for b in range(B):
        for t in range(S):
            for lag in range(w.shape[0]):
                if t - lag >= 0 and seg[b, t - lag] == seg[b, t]:
                    out[b, t] += w[lag] * x[b, t - lag]
    return out


def test_short_conv_is_the_identity_at_init():
    x = RNG.normal(size=(2, 9, 5)).astype(np.float32)
    seg = np.array([[1, 1, 1, 2, 2, 2, 2, 0, 0], [1] * 9])
    w = np.zeros((4, 5), np.float32)
    w[0] = 1
    out = ShortConv(jnp.asarray(w))(jnp.asarray(x), jnp.asarray(seg))
    np.testing.assert_array_equal(np.asarray(out), x)


def test_short_conv_matches_a_naive_loop_with_zeroed_taps_across_documents():
    x = RNG.normal(size=(2, 11, 6)).astype(np.float32)
    seg = np.array([[1, 1, 2, 2, 2, 2, 2, 3, 0, 0, 0], [4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5]])
    for k in (1, 2, 4):
        w = RNG.normal(size=(k, 6)).astype(np.float32)
        out = ShortConv(jnp.asarray(w))(jnp.asarray(x), jnp.asarray(seg))
        np.testing.assert_allclose(np.asarray(out), naive_sconv(x, w, seg), rtol=1e-5, atol=1e-6)


def test_shard_batch_pins_the_leading_dim_to_every_mesh_axis_and_is_a_no_op_without_a_mesh():
    x = jnp.ones((8, 3))
    assert shard_batch(x) is x
    mesh = make_mesh(ParallelConfig(replica=1, data=2, expert=4))
    with jax.set_mesh(mesh):
        y = jax.jit(shard_batch)(x)
        odd = jax.jit(shard_batch)(jnp.ones((6, 3)))  # 6 rows do not split 8 ways: left to the partitioner
    assert y.sharding.spec == PartitionSpec(("data", "expert"))
    assert odd.shape == (6, 3)
