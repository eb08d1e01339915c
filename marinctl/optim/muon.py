"""The Muon direction (docs/recipe.md §5): Nesterov momentum, then Newton-Schulz orthogonalization per matrix.

optax.contrib.muon is close but not this: it keeps an EMA `m <- b*m + (1-b)*g` with bias correction
and normalizes with `jnp.linalg.norm`; docs/recipe.md §5 asks for `m <- 0.95*m + g`, `u = 0.95*m + g` and explicit
fp32 norms. The hyperball step that follows rescales the direction per norm scope, so only the shape
of the orthogonalized matrix matters here, not its overall scale.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float

from marinctl.optim.hyperball import frobenius_norm
from marinctl.params import ns_spread_axes, ns_spread_ways, path_str

UNCONSTRAINED = PartitionSpec.UNCONSTRAINED

Coefficients = tuple[tuple[float, float, float], ...]
Pin = Callable[[Array], Array]

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
    experts_dim: int | None = None,
) -> Float[Array, "*matrices rows cols"]:  # noqa: F722
    """Orthogonalize each matrix in the last two axes (leading axes: layers, experts, shared experts).

    Works on the wide orientation (transposed when rows > cols) so A = XX^T is the smaller Gram matrix.
    Runs in fp32; matmul precision is the backend default (Muon tolerates TF32/bf16 products). Under a
    mesh the matrices are spread whole over the devices first (`spread_matrices`; `experts_dim`: the
    stack dim that expert parallelism splits, if any).
    """
    x, pin, unspread = spread_matrices(u.astype(jnp.float32), experts_dim)
    x = x / (frobenius_norm(x, (-2, -1)) + 1e-8)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = jnp.swapaxes(x, -1, -2)

    def iteration(x, abc):
        a, b, c = abc[0], abc[1], abc[2]
        gram = x @ jnp.swapaxes(x, -1, -2)
        return pin(a * x + (b * gram + c * (gram @ gram)) @ x), None

    # A scan over the table, not a Python loop: one compiled body per leaf instead of five.
    x, _ = jax.lax.scan(iteration, x, jnp.asarray(coefficients, jnp.float32))
    if transposed:
        x = jnp.swapaxes(x, -1, -2)
    return unspread(x)


def spread_matrices(
    x: Float[Array, "*matrices rows cols"],  # noqa: F722
    experts_dim: int | None = None,
) -> tuple[Array, Pin, Pin]:
    """Under a mesh with spread axes (`marinctl.params.ns_spread_axes`): the stack as [k * ceil(n / k), rows,
    cols] (zero-padded), its leading dim sharded over those k devices; the constraint that keeps an iterate
    so; and the map back to `x`'s shape. Else `x` and two identities.

    A parameter arrives FSDP-sharded inside its matrices, where XLA partitions each product with collectives
    and runs the Gram's square in full on every device. Whole matrices per device cut every device's share
    to ceil(n / k) of them, with one all-to-all in and one out (bench/README.md, stop 45). The iterate is
    pinned after every iteration: left to propagation, the parameter's sharding flows back into the loop.
    A zero matrix comes out zero (normalized by 0 + eps).

    How the stack merges into one dim decides what moves. An expert stack split over `expert` merges
    experts-major, so each device's matrices stay where they are. Any other stack is unsharded (the sharding
    rules never split `layers` or `shared`) and merges pinned so; without that pin XLA pushes the spread
    sharding back through the merge onto several dims at once, which it can only do by gathering the whole
    leaf on every device.
    """
    mesh = jax.sharding.get_abstract_mesh()
    sizes = {} if mesh.empty else dict(mesh.shape)
    axes = ns_spread_axes(sizes)
    if not axes or x.ndim < 3:
        return x, _same, _same
    ways = ns_spread_ways(sizes)
    count = math.prod(x.shape[:-2])
    experts_major = experts_dim is not None and "expert" in axes
    order = (experts_dim, *(d for d in range(x.ndim) if d != experts_dim)) if experts_major else tuple(range(x.ndim))
    undo = tuple(order.index(d) for d in range(x.ndim))
    flat = jnp.transpose(x, order).reshape(count, *x.shape[-2:])
    if not experts_major:
        flat = jax.lax.with_sharding_constraint(flat, PartitionSpec(None, UNCONSTRAINED, UNCONSTRAINED))
    if pad := -count % ways:
        flat = jnp.pad(flat, ((0, pad), (0, 0), (0, 0)))
    spec = PartitionSpec(axes if len(axes) > 1 else axes[0], None, None)

    def pin(y: Array) -> Array:
        return jax.lax.with_sharding_constraint(y, spec)

    def unspread(y: Array) -> Array:
        y = pin(y)[:count]
        if not experts_major:
            y = jax.lax.with_sharding_constraint(y, PartitionSpec(None, UNCONSTRAINED, UNCONSTRAINED))
        return jnp.transpose(y.reshape(*(x.shape[d] for d in order)), undo)

    return pin(flat), pin, unspread


def _same(y: Array) -> Array:
    return y


class MuonState(NamedTuple):
    momentum: optax.Updates  # fp32, shaped (and sharded) like the parameters


def scale_by_muon(
    momentum: float, coefficients: Coefficients, experts_dims: Mapping[str, int] | None = None
) -> optax.GradientTransformation:
    """Gradients -> orthogonalized Nesterov momentum, per matrix in each leaf's last two axes.

    `experts_dims`: parameter path -> the dim of its `experts` axis, for the expert stacks (from the
    parameter table), which Newton-Schulz spreads over the mesh without moving them.
    """
    experts_dims = dict(experts_dims or {})

    def init(params: optax.Params) -> MuonState:
        return MuonState(jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))

    def update(updates: optax.Updates, state: MuonState, params: optax.Params | None = None):
        del params
        new_momentum = jax.tree.map(lambda m, g: momentum * m + g.astype(jnp.float32), state.momentum, updates)
        direction = jax.tree_util.tree_map_with_path(
            lambda path, m, g: newton_schulz(
                momentum * m + g.astype(jnp.float32), coefficients, experts_dims.get(path_str(path))
            ),
            new_momentum,
            updates,
        )
        return direction, MuonState(new_momentum)

    return optax.GradientTransformation(init, update)
