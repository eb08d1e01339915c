"""The Muon direction (docs/recipe.md §5): Nesterov momentum, then Newton-Schulz orthogonalization per matrix.

optax.contrib.muon is close but not this: it keeps an EMA `m <- b*m + (1-b)*g` with bias correction
and normalizes with `jnp.linalg.norm`; docs/recipe.md §5 asks for `m <- 0.95*m + g`, `u = 0.95*m + g` and explicit
fp32 norms. The hyperball step that follows rescales the direction per norm scope, so only the shape
of the orthogonalized matrix matters here, not its overall scale.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float

from marinctl.optim.hyperball import frobenius_norm

Coefficients = tuple[tuple[float, float, float], ...]

# Per-iteration (a, b, c) of X <- aX + (bA + cA^2)X, A = XX^T. "tuned" (the run's table) drives every
# singular value in [~3e-3, 1] of X/||X||_F into about [0.978, 1.145]; "simple" (Keller Jordan's one
# quintic repeated) into about [0.68, 1.21]. Neither converges to exactly 1: steeper slope at 0 buys
# fewer iterations, which Muon tolerates.
NS_COEFFICIENTS: dict[str, Coefficients] = {
    "tuned": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "simple": ((3.4445, -4.7750, 2.0315),) * 5,
}


def coefficient_schedule(table: str, steps: int) -> Coefficients:
    """The (a, b, c) of each of `steps` iterations; past the table's end its last row repeats."""
    rows = NS_COEFFICIENTS[table]
    return tuple(rows[min(i, len(rows) - 1)] for i in range(steps))


def newton_schulz(
    u: Float[Array, "*matrices rows cols"],  # noqa: F722 (jaxtyping shape string)
    coefficients: Coefficients,
) -> Float[Array, "*matrices rows cols"]:  # noqa: F722
    """Orthogonalize each matrix in the last two axes (leading axes: layers, experts, shared experts).

    Works on the wide orientation (transposed when rows > cols) so A = XX^T is the smaller Gram matrix.
    Runs in fp32; matmul precision is the backend default (Muon tolerates TF32/bf16 products).
    """
    x = u.astype(jnp.float32)
    x = x / (frobenius_norm(x, (-2, -1)) + 1e-8)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = jnp.swapaxes(x, -1, -2)

    def iteration(x, abc):
        a, b, c = abc[0], abc[1], abc[2]
        gram = x @ jnp.swapaxes(x, -1, -2)
        return a * x + (b * gram + c * (gram @ gram)) @ x, None

    # A scan over the table, not a Python loop: one compiled body per leaf instead of five.
    x, _ = jax.lax.scan(iteration, x, jnp.asarray(coefficients, jnp.float32))
    if transposed:
        x = jnp.swapaxes(x, -1, -2)
    return x


class MuonState(NamedTuple):
    momentum: optax.Updates  # fp32, shaped (and sharded) like the parameters


def scale_by_muon(momentum: float, coefficients: Coefficients) -> optax.GradientTransformation:
    """Gradients -> orthogonalized Nesterov momentum, per matrix in each leaf's last two axes."""

    def init(params: optax.Params) -> MuonState:
        return MuonState(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

    def update(updates: optax.Updates, state: MuonState, params: optax.Params | None = None):
        del params
        new_momentum = jax.tree.map(lambda m, g: momentum * m + g.astype(jnp.float32), state.momentum, updates)
        direction = jax.tree.map(
            lambda m, g: newton_schulz(momentum * m + g.astype(jnp.float32), coefficients), new_momentum, updates
        )
        return direction, MuonState(new_momentum)

    return optax.GradientTransformation(init, update)
