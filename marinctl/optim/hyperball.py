"""The hyperball step (docs/recipe.md §5): move along a direction, then project back to the initial norm.

`p' = p - lr * n * u / ||u||`, `p_new = n * p' / ||p'||`, with `n = ||p_0||` frozen in the optimizer
state at `init`. The step is relative (lr is the fraction of the matrix norm moved per step), and the
norm can never drift: hyperball needs no weight decay, and linear LR decay is the only decay there is.

Norms are `sqrt(sum(x * x))` in fp32 over explicit axes, never `jnp.linalg.norm`: the public run lost
its lm_head norm (150.7 -> 21.4 in one update) to `jnp.linalg.norm` on a sharded array on GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float

from marinctl.params import path_str


def frobenius_norm(x: Float[Array, "..."], axes: tuple[int, ...]) -> Float[Array, "..."]:
    """sqrt(sum(x^2)) over `axes` in fp32, keeping reduced axes as size 1 so it broadcasts against x."""
    x = x.astype(jnp.float32)
    return jnp.sqrt(jnp.sum(x * x, axis=axes, keepdims=True))


class HyperballState(NamedTuple):
    count: Array  # int32 scalar: steps taken, the schedule's argument
    initial_norm: optax.Params  # per leaf: fp32 norms over its kept leading axes ([L], [L, n] or [])


def hyperball(
    learning_rate: optax.ScalarOrSchedule, norm_axes: Mapping[str, tuple[int, ...]]
) -> optax.GradientTransformation:
    """Direction `u` -> the update `p_new - p` that keeps every norm scope at its initial norm.

    `norm_axes` maps each leaf's dotted path to the axes its norm reduces over (the rest index separate
    scopes: layers, shared experts; `marinctl.optim.groups.norm_axes`). Requires `params` at update.
    """

    def axes_of(path) -> tuple[int, ...]:
        key = path_str(path)
        if key not in norm_axes:
            raise KeyError(f"no hyperball norm scope for parameter {key!r}")
        return norm_axes[key]

    def init(params: optax.Params) -> HyperballState:
        def norm(path, p):
            axes = axes_of(path)
            return jnp.squeeze(frobenius_norm(p, axes), axis=axes)

        norms = jax.tree_util.tree_map_with_path(norm, params)
        return HyperballState(jnp.zeros([], jnp.int32), norms)

    def update(updates: optax.Updates, state: HyperballState, params: optax.Params | None = None):
        if params is None:
            raise ValueError("hyperball needs the current parameters: call update(grads, state, params)")
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate

        def step(path, u, p, n):
            axes = axes_of(path)
            n = jnp.expand_dims(n, axes)
            p32 = p.astype(jnp.float32)
            moved = p32 - lr * n * u / jnp.maximum(frobenius_norm(u, axes), 1e-10)
            projected = n * moved / jnp.maximum(frobenius_norm(moved, axes), 1e-10)
            return (projected - p32).astype(p.dtype)

        new = jax.tree_util.tree_map_with_path(step, updates, params, state.initial_norm)
        return new, HyperballState(optax.safe_increment(state.count), state.initial_norm)

    return optax.GradientTransformation(init, update)


def initial_norms(opt_state: optax.OptState) -> dict[str, Array]:
    """{parameter path: frozen initial norm} from an optimizer state (shape: the kept axes).

    The drift monitor compares these with `marinctl.optim.groups.hyperball_norms(params, recipe)`.
    """
    out: dict[str, Array] = {}
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, HyperballState))
    for node in nodes:
        if isinstance(node, HyperballState):
            for path, norm in jax.tree_util.tree_flatten_with_path(node.initial_norm)[0]:
                out[path_str(path)] = norm
    return out
