"""The train step: one function from (state, batch) to (next state, metrics), jitted once per run.

    loss, grads   value_and_grad of `model_loss` (gradient accumulation: a scan over micro-batches,
                  each weighted by its share of the step's loss tokens, so the sum is the full-batch grad)
    finite        loss and global grad norm finite; otherwise params, optimizer state and router bias
                  are kept as they were, the step still advances (the batch is consumed) and is counted
    update        the hyperball optimizer (marinctl/optim)
    router bias   replaced by QB: b ← −(β − mean β) from this step's quantile estimate (docs/recipe.md §3.5)

The state buffers are donated: the step updates the model in place. Metrics include what the health
monitors read (norms per matrix and per scope, per-group and per-expert gradient norms).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array

from marinctl.model.loss import model_loss
from marinctl.optim.groups import group_of, norm_axes
from marinctl.optim.hyperball import frobenius_norm
from marinctl.params import param_table, tree_paths
from marinctl.recipe import Recipe
from marinctl.routing.quantile_balance import router_bias, routing_metrics
from marinctl.runtime import host_pages_released
from marinctl.train.state import TrainState

Batch = dict[str, Array]
EXPERT_PATHS = ("blocks.moe.experts.w_gate", "blocks.moe.experts.w_up", "blocks.moe.experts.w_down")


def _named(tree) -> dict[str, Array]:
    return dict(zip(jax.tree.leaves(tree_paths(tree)), jax.tree.leaves(tree), strict=True))


def param_norms(model, recipe: Recipe) -> dict[str, Array]:
    """fp32 Frobenius norm of every leaf per hyperball scope (per layer, per shared expert; an expert
    stack jointly per layer): the per-matrix norms docs/recipe.md §10 asks to watch, gains included (the lm_head
    input gain grows without the z-loss)."""
    table = param_table(recipe)
    out = {}
    for path, leaf in _named(model).items():
        axes = norm_axes(table[path])
        out[path] = jnp.squeeze(frobenius_norm(leaf, axes), axis=axes)
    return out


def gradient_norms(grads) -> dict[str, Array]:
    """Global and per-group gradient norms, the embedding's, and per-expert norms [L, E]."""
    named = _named(grads)
    squares = {path: jnp.sum(jnp.square(g.astype(jnp.float32))) for path, g in named.items()}
    out = {"grad_norm": jnp.sqrt(sum(squares.values()))}
    for group in ("adam", "adamh", "muonh"):
        members = [s for p, s in squares.items() if group_of(p) == group]
        if members:
            out[f"grad_norm/{group}"] = jnp.sqrt(sum(members))
    if "embed.weight" in squares:
        out["embed_grad_norm"] = jnp.sqrt(squares["embed.weight"])
    experts = [named[p] for p in EXPERT_PATHS if p in named]
    if experts:  # [L, E, in, out] each: reduce the matrix axes
        out["expert_grad_norm"] = jnp.sqrt(
            sum(jnp.sum(jnp.square(g.astype(jnp.float32)), axis=(2, 3)) for g in experts)
        )
    return out


def loss_and_grads(model, batch: Batch, bias: Array, recipe: Recipe) -> tuple[Array, dict[str, Array], object]:
    """(loss, aux, grads) over the step's batch, accumulated over `train.grad_accum` micro-batches."""
    grad_fn = eqx.filter_value_and_grad(lambda m, b: model_loss(m, b, bias, recipe), has_aux=True)
    accum = recipe.train.grad_accum
    if accum == 1:
        (loss, aux), grads = grad_fn(model, batch)
        return loss, aux, grads

    # Row r goes to micro-batch r % accum: every device contributes equally to every micro-batch.
    def split(x: Array) -> Array:
        return jnp.swapaxes(x.reshape(x.shape[0] // accum, accum, *x.shape[1:]), 0, 1)

    micro = jax.tree.map(split, batch)
    total = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)

    def body(carry, mb):
        (loss, aux), grads = grad_fn(model, mb)
        w = jnp.maximum(jnp.sum(mb["loss_mask"]), 1.0) / total  # lm_loss means over this micro's tokens
        acc_loss, acc_aux, acc_grads = carry
        acc_grads = jax.tree.map(lambda a, g: a + w * g, acc_grads, grads)
        return (acc_loss + w * loss, _accumulate(acc_aux, aux, w, accum), acc_grads), None

    (_, aux_shapes), _ = eqx.filter_eval_shape(grad_fn, model, jax.tree.map(lambda x: x[0], micro))
    zero_aux = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shapes)
    zero_grads = jax.tree.map(jnp.zeros_like, eqx.filter(model, eqx.is_inexact_array))
    (loss, aux, grads), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zero_aux, zero_grads), micro)
    return loss, aux, grads


def _accumulate(acc: dict[str, Array], aux: dict[str, Array], w: Array, accum: int) -> dict[str, Array]:
    """Token-weighted loss parts; summed routing counts; β averaged over micro-batches (each micro-batch
    routes with the same bias, so the mean estimate is the quantile of the pooled margins to first order)."""
    out = {}
    for key, value in aux.items():
        if key in ("ce", "z_loss"):
            out[key] = acc[key] + w * value
        elif key in ("beta", "router_z"):
            out[key] = acc[key] + value / accum
        else:
            out[key] = acc[key] + value
    return out


def train_step(state: TrainState, batch: Batch, *, recipe: Recipe, optimizer: optax.GradientTransformation):
    model = state.model
    loss, aux, grads = loss_and_grads(model, batch, state.router_bias, recipe)
    gnorms = gradient_norms(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(gnorms["grad_norm"])

    new_bias = router_bias(aux["beta"]) if recipe.moe.balancing == "quantile" else state.router_bias
    params, static = eqx.partition(model, eqx.is_array)

    # A branch, not `where(finite, new, old)` per leaf: the select keeps every old optimizer-state buffer alive
    # until the end of the step, so XLA copied the whole optimizer state each step to update it in place
    # (the donated input is the output's buffer); a skipped step also no longer computes the update.
    def apply(operands):
        params, opt_state = operands
        updates, opt_state = optimizer.update(grads, opt_state, eqx.combine(params, static))
        return eqx.apply_updates(params, updates), opt_state, new_bias.astype(state.router_bias.dtype)

    def keep(operands):
        params, opt_state = operands
        return params, opt_state, state.router_bias

    new_params, opt_state, bias = jax.lax.cond(finite, apply, keep, (params, state.opt_state))
    next_state = TrainState(
        model=eqx.combine(new_params, static),
        opt_state=opt_state,
        router_bias=bias,
        step=state.step + 1,
        rng=state.rng,
        nonfinite_skipped=state.nonfinite_skipped + (~finite).astype(jnp.int32),
    )
    routing = routing_metrics(aux)
    drops = jnp.sum(aux["sender_drops"]) + jnp.sum(aux["receiver_drops"])
    metrics = {
        "loss": loss,
        "ce": aux["ce"],
        "z_loss": aux["z_loss"],
        "finite": finite,
        "nonfinite_skipped": next_state.nonfinite_skipped,
        "drop_frac": drops / jnp.maximum(jnp.sum(aux["assignments"]), 1.0),
        "routing_entropy": jnp.mean(routing["routing_entropy"]),
        "drop_frac_per_layer": routing["drop_fraction"],
        "sender_drop_frac_per_layer": routing["sender_drop_fraction"],
        "receiver_drop_frac_per_layer": routing["receiver_drop_fraction"],
        "routing_entropy_per_layer": routing["routing_entropy"],
        "max_mean_load_per_layer": routing["max_mean_load"],
        "router_z_per_layer": aux["router_z"],
        "tokens": jnp.sum(batch["loss_mask"]),
        **gnorms,
        "param_norms": param_norms(next_state.model, recipe),
    }
    return next_state, metrics


def compile_train_step(
    recipe: Recipe,
    optimizer: optax.GradientTransformation,
    shardings: TrainState,
    batch_sharding: NamedSharding,
    compiler_options: dict[str, str | bool | int] | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
    """The step compiled ahead of time for the state's abstract shapes: state sharded by `shardings` and
    donated, batch rows over every mesh axis. Compiling before the loop keeps compile time out of step
    timings, and the persistent cache makes a resumed run's compile a lookup. `compiler_options` (XLA
    debug options for this compile only) lets bench/ab_step.py compare XLA settings in one process."""
    from marinctl.train.state import abstract_state, with_shardings

    replicated = NamedSharding(batch_sharding.mesh, PartitionSpec())
    jitted = jax.jit(
        functools.partial(train_step, recipe=recipe, optimizer=optimizer),
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, replicated),
        donate_argnums=0,
    )
    abstract = with_shardings(abstract_state(recipe, optimizer), shardings)
    with host_pages_released():  # the compiler's garbage is not kept for the step loop
        return jitted.lower(abstract, batch_spec(recipe, batch_sharding)).compile(compiler_options=compiler_options)


def batch_spec(recipe: Recipe, sharding: NamedSharding, rows: int | None = None) -> dict[str, jax.ShapeDtypeStruct]:
    shape = (rows or recipe.train.batch_size, recipe.train.seq_len)
    dtypes = {"tokens": jnp.int32, "targets": jnp.int32, "segment_ids": jnp.int32, "loss_mask": jnp.float32}
    return {k: jax.ShapeDtypeStruct(shape, dt, sharding=sharding) for k, dt in dtypes.items()}


def compile_param_norms(recipe: Recipe, shardings: TrainState) -> Callable[[TrainState], dict[str, Array]]:
    """Norms of a state's model outside the step (the initial hyperball radii of a fresh run)."""
    replicated = NamedSharding(jax.tree.leaves(shardings)[0].mesh, PartitionSpec())
    return jax.jit(lambda s: param_norms(s.model, recipe), in_shardings=(shardings,), out_shardings=replicated)


def device_batch(host_rows: dict[str, np.ndarray], sharding: NamedSharding, global_rows: int) -> Batch:
    """This host's rows of a batch -> global arrays sharded over every mesh axis (each host feeds its share)."""
    return {
        key: jax.make_array_from_process_local_data(sharding, value, (global_rows, *value.shape[1:]))
        for key, value in host_rows.items()
    }
