"""The hyperball step (marinctl/optim/hyperball.py) against numpy: frozen norms, per-scope projection."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marinctl.optim.hyperball import frobenius_norm, hyperball, initial_norms

# A layer-stacked matrix, an expert stack (one norm per layer over all experts), a single matrix.
SCOPES = {"w_q": (1, 2), "experts": (1, 2, 3), "head": (0, 1)}
SHAPES = {"w_q": (3, 8, 12), "experts": (3, 4, 6, 5), "head": (10, 7)}


def numpy_hyperball(p: np.ndarray, u: np.ndarray, n: np.ndarray, lr: float, axes) -> np.ndarray:
    def norm(x):
        return np.sqrt(np.sum(x * x, axis=axes, keepdims=True))

    moved = p - lr * n * u / np.maximum(norm(u), 1e-10)
    return n * moved / np.maximum(norm(moved), 1e-10)


def test_frobenius_norm_is_fp32_sqrt_sum_of_squares_over_the_given_axes():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4, 5)), jnp.bfloat16)
    out = frobenius_norm(x, (1, 2))
    assert out.dtype == jnp.float32 and out.shape == (3, 1, 1)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    np.testing.assert_allclose(np.asarray(out)[:, 0, 0], np.sqrt((x64**2).sum(axis=(1, 2))), rtol=1e-6)


def test_hyperball_steps_equal_numpy_with_norms_frozen_at_init():
    rng = np.random.default_rng(1)
    params = {k: jnp.asarray(rng.standard_normal(s), jnp.float32) for k, s in SHAPES.items()}
    initial = {k: np.sqrt(np.sum(np.float64(v) ** 2, axis=SCOPES[k], keepdims=True)) for k, v in params.items()}
    schedule = optax.linear_schedule(0.05, 0.2, 4)
    transform = hyperball(schedule, SCOPES)
    state = transform.init(params)
    for k, n in initial_norms(state).items():
        np.testing.assert_allclose(n, initial[k].squeeze(axis=SCOPES[k]), rtol=1e-6)
    expected = {k: np.asarray(v, np.float64) for k, v in params.items()}
    for step in range(3):
        u = {k: rng.standard_normal(s) for k, s in SHAPES.items()}
        updates, state = transform.update(jax.tree.map(jnp.asarray, u), state, params)
        params = optax.apply_updates(params, updates)
        lr = float(schedule(step))
        for k in SHAPES:
            expected[k] = numpy_hyperball(expected[k], u[k], initial[k], lr, SCOPES[k])
            np.testing.assert_allclose(np.asarray(params[k]), expected[k], atol=2e-6, err_msg=k)
    # The projection really is per scope: each layer of the expert stack keeps its own norm, jointly over experts.
    now = np.sqrt(np.sum(np.asarray(params["experts"], np.float64) ** 2, axis=(1, 2, 3)))
    np.testing.assert_allclose(now, initial["experts"].ravel(), rtol=1e-6)


def test_hyperball_moves_each_scope_by_the_learning_rate_fraction_of_its_norm():
    # Small steps along a direction orthogonal to p move p by ~lr * n (the step is relative).
    rng = np.random.default_rng(2)
    p = rng.standard_normal((2, 30, 40))
    u = rng.standard_normal((2, 30, 40))
    u -= p * np.sum(u * p, axis=(1, 2), keepdims=True) / np.sum(p * p, axis=(1, 2), keepdims=True)
    transform = hyperball(1e-3, {"w": (1, 2)})
    params = {"w": jnp.asarray(p, jnp.float32)}
    delta, _ = transform.update({"w": jnp.asarray(u, jnp.float32)}, transform.init(params), params)
    moved = np.sqrt(np.sum(np.asarray(delta["w"], np.float64) ** 2, axis=(1, 2)))
    np.testing.assert_allclose(moved, 1e-3 * np.sqrt(np.sum(p * p, axis=(1, 2))), rtol=1e-3)


def test_hyperball_without_params_or_scope_is_an_error():
    transform = hyperball(0.1, {"w": (0, 1)})
    params = {"w": jnp.ones((2, 2))}
    state = transform.init(params)
    with pytest.raises(ValueError, match="current parameters"):
        transform.update(params, state)
    with pytest.raises(KeyError, match="'v'"):
        transform.init({"v": jnp.ones((2, 2))})
