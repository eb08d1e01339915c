"""The train state: everything a run needs to continue bitwise-identically after a restart.

model (fp32 master weights), optimizer state, the QB router bias (docs/recipe.md §3: replaced every step, not a
parameter), the step (= the data position: the loader's batch is a pure function of (seed, step)), the
root RNG key and the count of skipped non-finite steps. All leaves are arrays, so the whole state is
sharded, donated and checkpointed as one pytree.
"""

# ruff: noqa: F722 (jaxtyping shape strings are not Python expressions)

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, Float, Int, UInt32

from marinctl.model.transformer import Transformer, init_model
from marinctl.optim import build_optimizer, optimizer_state_shardings
from marinctl.recipe import Recipe
from marinctl.routing.mesh import param_shardings


class TrainState(eqx.Module):
    model: Transformer
    opt_state: optax.OptState
    router_bias: Float[Array, "layers experts"]
    step: Int[Array, ""]  # updates done, and the index of the next batch
    rng: UInt32[Array, "2"]  # root key data; a consumer derives fold_in(key, step), so resuming is exact
    nonfinite_skipped: Int[Array, ""]  # steps whose update was skipped (non-finite loss or gradient)


def model_key(recipe: Recipe) -> jax.Array:
    return jax.random.key(recipe.train.seed)


def abstract_model(recipe: Recipe) -> Transformer:
    """Shapes and dtypes only (nothing allocated): what sharding plans, the optimizer and restores read."""
    return eqx.filter_eval_shape(init_model, recipe, model_key(recipe))


def make_optimizer(recipe: Recipe) -> optax.GradientTransformation:
    return build_optimizer(recipe, abstract_model(recipe))


def init_state(recipe: Recipe, optimizer: optax.GradientTransformation) -> TrainState:
    """A fresh state; call under `jax.jit(..., out_shardings=state_shardings(...))` so each device only
    ever materializes its own shards."""
    model = init_model(recipe, model_key(recipe))
    L, E = recipe.model.num_layers, recipe.moe.num_experts
    return TrainState(
        model=model,
        opt_state=optimizer.init(model),
        router_bias=jnp.zeros((L, E), jnp.float32),  # b = 0 until the first QB estimate (docs/recipe.md §3.5)
        step=jnp.zeros((), jnp.int32),
        rng=jax.random.key_data(jax.random.fold_in(model_key(recipe), 1)),
        nonfinite_skipped=jnp.zeros((), jnp.int32),
    )


def abstract_state(recipe: Recipe, optimizer: optax.GradientTransformation) -> TrainState:
    return eqx.filter_eval_shape(init_state, recipe, optimizer)


def state_shardings(
    recipe: Recipe, optimizer: optax.GradientTransformation, mesh: Mesh | jax.sharding.AbstractMesh
) -> TrainState:
    """NamedShardings for every leaf: parameters by the table's rule, optimizer state like its parameter,
    the small rest replicated."""
    model = abstract_model(recipe)
    params = param_shardings(model, recipe, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    return TrainState(
        model=params,
        opt_state=optimizer_state_shardings(optimizer, model, params),
        router_bias=replicated,
        step=replicated,
        rng=replicated,
        nonfinite_skipped=replicated,
    )


def with_shardings(abstract: TrainState, shardings: TrainState) -> TrainState:
    """ShapeDtypeStructs carrying their target sharding (orbax restores straight into the layout)."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
