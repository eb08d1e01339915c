"""Newton-Schulz and the Muon direction (marinctl/optim/muon.py) against numpy oracles."""

import jax.numpy as jnp
import numpy as np
import pytest

from marinctl.optim.muon import NS_COEFFICIENTS, coefficient_schedule, newton_schulz, scale_by_muon

# The band each table is designed to leave every singular value in, for inputs whose singular values
# (after the Frobenius normalization) are at least SIGMA_MIN: iterating the scalar polynomials over
# [3e-3, 1] gives [0.9778, 1.1450] (tuned) and [0.6818, 1.2024] (simple).
SIGMA_MIN = 3e-3
BANDS = {"tuned": (0.977, 1.146), "simple": (0.681, 1.203)}


def scalar_map(sigma: np.ndarray, coefficients) -> np.ndarray:
    """What NS does to each singular value: X -> aX + b(XX^T)X + c(XX^T)^2 X maps s -> as + bs^3 + cs^5."""
    for a, b, c in coefficients:
        sigma = a * sigma + b * sigma**3 + c * sigma**5
    return sigma


def singular_vectors(rng: np.random.Generator, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    rank = min(rows, cols)
    u, _ = np.linalg.qr(rng.standard_normal((rows, rank)))
    v, _ = np.linalg.qr(rng.standard_normal((cols, rank)))
    return u, v


def test_coefficient_tables_are_spec_5s():
    assert NS_COEFFICIENTS["tuned"][0] == (4.0848, -6.8946, 2.9270)
    assert NS_COEFFICIENTS["tuned"][-1] == (2.8366, -3.0525, 1.2012)
    assert NS_COEFFICIENTS["simple"] == ((3.4445, -4.7750, 2.0315),) * 5
    assert coefficient_schedule("tuned", 7)[5:] == (NS_COEFFICIENTS["tuned"][-1],) * 2


@pytest.mark.parametrize("table", ["tuned", "simple"])
@pytest.mark.parametrize("shape", [(96, 96), (48, 112), (112, 48)], ids=["square", "wide", "tall"])
def test_newton_schulz_singular_values_follow_the_polynomial_into_the_designed_band(table, shape):
    rng = np.random.default_rng(0)
    u, v = singular_vectors(rng, *shape)
    # Spread over two decades (relative), at an arbitrary overall scale the normalization must remove.
    sigma = 37.0 * np.geomspace(1.0, 0.01, min(shape))
    x = (u * sigma) @ v.T
    out = np.asarray(newton_schulz(jnp.asarray(x, jnp.float32), coefficient_schedule(table, 5)), np.float64)
    normalized = sigma / np.sqrt(np.sum(x * x))
    assert normalized.min() >= SIGMA_MIN
    mapped = scalar_map(normalized, coefficient_schedule(table, 5))
    # NS keeps the singular vectors and maps each singular value by the scalar polynomial: U f(S) V^T.
    np.testing.assert_allclose(out, (u * mapped) @ v.T, atol=5e-5)
    got = np.linalg.svd(out, compute_uv=False)
    lo, hi = BANDS[table]
    assert lo <= got.min() and got.max() <= hi


def test_newton_schulz_treats_each_leading_index_as_its_own_matrix():
    rng = np.random.default_rng(1)
    stack = rng.standard_normal((2, 3, 16, 24)).astype(np.float32)
    stack[1, 2] *= 1000.0  # one matrix far larger: a joint normalization would crush the others
    coefficients = coefficient_schedule("tuned", 5)
    together = np.asarray(newton_schulz(jnp.asarray(stack), coefficients))
    for i in range(2):
        for j in range(3):
            alone = np.asarray(newton_schulz(jnp.asarray(stack[i, j]), coefficients))
            np.testing.assert_allclose(together[i, j], alone, atol=1e-5)


def numpy_newton_schulz(u: np.ndarray, coefficients) -> np.ndarray:
    x = u / (np.sqrt(np.sum(u * u)) + 1e-8)
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    for a, b, c in coefficients:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def test_muon_direction_is_nesterov_momentum_then_newton_schulz_like_numpy():
    rng = np.random.default_rng(2)
    coefficients = coefficient_schedule("tuned", 5)
    params = {"w": jnp.zeros((40, 24), jnp.float32)}
    grads = [rng.standard_normal((40, 24)).astype(np.float32) for _ in range(3)]
    muon = scale_by_muon(0.95, coefficients)
    state = muon.init(params)
    m = np.zeros((40, 24))
    for g in grads:
        out, state = muon.update({"w": jnp.asarray(g)}, state, params)
        m = 0.95 * m + g  # docs/recipe.md §5: m <- 0.95 m + g (no (1 - beta) damping, no bias correction)
        expected = numpy_newton_schulz(0.95 * m + g, coefficients)
        np.testing.assert_allclose(np.asarray(out["w"]), expected, atol=2e-5)
        np.testing.assert_allclose(np.asarray(state.momentum["w"]), m, atol=1e-6)
