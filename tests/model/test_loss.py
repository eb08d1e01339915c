"""Cross-entropy and the logit z-loss against numpy; masked tokens never count."""

import jax
import jax.numpy as jnp
import numpy as np

from marinctl.model.loss import lm_loss

RNG = np.random.default_rng(0)
B, S, V = 2, 7, 11


def np_loss(logits, targets, mask, weight):
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    target = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    n = mask.sum()
    return ((lse - target) * mask).sum() / n, weight * (lse**2 * mask).sum() / n


def test_cross_entropy_and_z_loss_equal_numpy_over_unmasked_tokens():
    logits = (RNG.normal(size=(B, S, V)) * 5 + 20).astype(np.float32)  # large lse: z-loss matters
    targets = RNG.integers(0, V, size=(B, S))
    mask = (RNG.uniform(size=(B, S)) > 0.3).astype(np.float32)
    loss, parts = jax.jit(lm_loss, static_argnums=3)(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask), 1e-4)
    ce, z = np_loss(logits.astype(np.float64), targets, mask, 1e-4)
    np.testing.assert_allclose(float(parts["ce"]), ce, rtol=1e-5)
    np.testing.assert_allclose(float(parts["z_loss"]), z, rtol=1e-5)
    np.testing.assert_allclose(float(loss), ce + z, rtol=1e-5)


def test_padding_and_masked_targets_change_neither_loss_nor_gradient():
    logits = RNG.normal(size=(B, S, V)).astype(np.float32)
    targets = RNG.integers(0, V, size=(B, S))
    mask = np.ones((B, S), np.float32)
    mask[0, 4:] = 0  # padding
    mask[1, 2] = 0  # a cross-document target
    grad_fn = jax.jit(jax.value_and_grad(lambda lg, t, m: lm_loss(lg, t, m, 1e-4)[0]))
    loss, grad = grad_fn(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
    noisy, bad_targets = logits.copy(), targets.copy()
    noisy[mask == 0] = RNG.normal(size=((mask == 0).sum(), V)) * 100
    bad_targets[mask == 0] = -1  # any pad id, even out of range
    loss2, grad2 = grad_fn(jnp.asarray(noisy), jnp.asarray(bad_targets), jnp.asarray(mask))
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad2)[mask == 1], np.asarray(grad)[mask == 1], rtol=1e-6)
    assert np.all(np.asarray(grad2)[mask == 0] == 0)
