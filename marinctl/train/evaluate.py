"""In-loop evaluation (docs/recipe.md §6): dropless loss per eval source, bits per byte, and the macro loss.

Dropless means every routed assignment is computed, whatever the training transport drops: the model
is re-assembled around the same arrays with a dropless transport, `ragged` (unbounded buffer) or `dense`
(the reference every transport is tested against); the two equal each other (docs/recipe.md §4).
`dense` runs every token through every expert, E/K times the expert work, and for hero-sized experts
would materialize a [tokens, E, I] intermediate past `DENSE_EVAL_BYTES` per device. Evaluation therefore
and inference use `ragged` wherever dense would do more than twice the routed work (the tiny recipe's
eval step, top-4 of 16: 321 vs 377 ms at 16 × 256 tokens and 2,005 vs 2,375 ms at 16 × 1,024; its forward
of 1 × 64 tokens 11.5 vs 12.2 ms, bench/README.md).
The macro loss is the unweighted mean over eval sources of each source's mean per-token loss (nats).

The context is the given recipe's `train.seq_len`: after a context extension (docs/recipe.md §8) the
trainer passes the recipe in effect, and again the run's first context (`marinctl.schedule.at_context`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array

from marinctl.model.loss import lm_loss
from marinctl.model.transformer import build_model, model_params
from marinctl.recipe import Recipe
from marinctl.runtime import host_pages_released
from marinctl.train.step import Batch, device_batch

DENSE_EVAL_BYTES = 1 << 30
DENSE_WORK_RATIO = 2


def dropless_transport(recipe: Recipe, tokens: int) -> str:
    """The dropless transport for a forward of `tokens` tokens per device, evaluation's and inference's:
    `ragged` where `dense` would compute more than DENSE_WORK_RATIO times the routed rows (E > 2K) or its
    [tokens, E, I] fp32 intermediate would pass DENSE_EVAL_BYTES, else `dense`. Ragged pads each expert's
    rows to whole tiles, but even a 64-token call of the tiny model ran faster through it (bench/README.md)."""
    if recipe.moe.num_experts > DENSE_WORK_RATIO * recipe.moe.top_k:
        return "ragged"
    dense_bytes = tokens * recipe.moe.num_experts * recipe.moe.expert_width * 4
    return "dense" if dense_bytes <= DENSE_EVAL_BYTES else "ragged"


def eval_transport(recipe: Recipe, n_devices: int) -> str:
    """The eval step's dropless transport: `dropless_transport` for its rows per device."""
    tokens = recipe.eval_tokens_per_batch // n_devices
    return dropless_transport(recipe, tokens)


def dropless_recipe(recipe: Recipe, n_devices: int) -> Recipe:
    # ragged is dropless only with its worst-case buffer: clear any `ragged_buffer_factor` bound.
    moe = dataclasses.replace(recipe.moe, transport=eval_transport(recipe, n_devices), ragged_buffer_factor=None)
    return recipe.replace(moe=moe)


# Fields of `moe` that only the token-dropping transports read (`routing.transports._capacity`): a
# dropless program does not depend on them, so a switch of the train transport keeps the eval program.
_DROPPING_ONLY = ("transport", "capacity_factor", "sender_capacity_factor", "waves", "ragged_buffer_factor")


def eval_key(recipe: Recipe, n_devices: int) -> tuple:
    """What a compiled eval step depends on: equal keys share one executable (the train step's
    `schedule.shape_key` would also tell apart recipes whose train transport, batch or steps differ).
    `attention.qk_mult` is an input of the program (`eval_sums`), not part of it."""
    moe = dropless_recipe(recipe, n_devices).moe
    kept = tuple((f.name, getattr(moe, f.name)) for f in dataclasses.fields(moe) if f.name not in _DROPPING_ONLY)
    a = recipe.attention
    attention = tuple((f.name, getattr(a, f.name)) for f in dataclasses.fields(a) if f.name != "qk_mult")
    return (recipe.train.seq_len, recipe.eval_rows, attention, moe.transport, kept)


def eval_sums(
    params: Mapping[str, Array], router_bias: Array, batch: Batch, qk_mult: Array, recipe: Recipe
) -> tuple[Array, Array]:
    """(Σ token CE in nats, Σ scored tokens) of one batch, dropless, with the training router bias.
    `recipe.moe.transport` must already be a dropless one (`dropless_recipe`). `qk_mult` (a scalar) stands in
    for `recipe.attention.qk_mult`: a context extension raises it (docs/recipe.md §8), and the eval at the
    run's first context after one then reuses the program compiled before it. It enters as the learnable
    per-head factor over a fixed multiplier of 1, the same product with the same operands."""
    attention = dataclasses.replace(recipe.attention, qk_mult=1.0, qk_mult_learnable=True)
    L, H = recipe.model.num_layers, recipe.model.num_heads
    learned = params.get("blocks.attention.qk_mult", jnp.ones((L, H), jnp.float32))
    params = {**params, "blocks.attention.qk_mult": learned * qk_mult}
    dropless = build_model(recipe.replace(attention=attention), params)
    logits, _ = dropless(batch["tokens"], batch["segment_ids"], router_bias)
    ce = lm_loss(logits, batch["targets"], batch["loss_mask"], 0.0)[1]["ce"]
    n_tokens = jnp.sum(batch["loss_mask"])
    return ce * jnp.maximum(n_tokens, 1.0), n_tokens  # lm_loss divides by max(n, 1)


class EvalStep:
    """`eval_sums` for `recipe`, jitted over the model's {path: array} dict rather than its module tree:
    the tree carries its segment's configs as static metadata (`moe.transport`), so the models of two
    segments are different pytrees even where their eval program (`eval_key`) is one."""

    def __init__(self, recipe: Recipe, model_shardings, batch_sharding: NamedSharding) -> None:
        self._recipe, self._batch_sharding = recipe, batch_sharding
        replicated = NamedSharding(batch_sharding.mesh, PartitionSpec())
        self._jitted = jax.jit(
            functools.partial(eval_sums, recipe=recipe),
            in_shardings=(model_params(model_shardings), replicated, batch_sharding, replicated),
            out_shardings=replicated,
        )
        self._call: Callable = self._jitted
        self._qk_mult = _scalar(recipe.attention.qk_mult, replicated)

    def at(self, recipe: Recipe) -> EvalStep:
        """This step's program for `recipe`, of the same `eval_key` but perhaps another `attention.qk_mult`."""
        if recipe.attention.qk_mult == self._recipe.attention.qk_mult:
            return self
        other = copy.copy(self)
        other._recipe = self._recipe.replace(attention=recipe.attention)
        other._qk_mult = _scalar(recipe.attention.qk_mult, self._qk_mult.sharding)
        return other

    def compile(self, model, router_bias) -> EvalStep:
        """Compile now, for the abstract state's model and router bias (`with_shardings(abstract_state(..))`),
        instead of at the first call: the trainer's precompile thread builds a later context's eval step
        while training goes on, so the eval after a context extension does not stall the run for its compiles."""
        from marinctl.train.step import batch_spec

        batch = batch_spec(self._recipe, self._batch_sharding, self._recipe.eval_rows)
        with host_pages_released():
            self._call = self.lower(model, router_bias, batch).compile()
        return self

    def __call__(self, model, router_bias: Array, batch: Batch) -> tuple[Array, Array]:
        return self._call(model_params(model), router_bias, batch, self._qk_mult)

    def lower(self, model, router_bias, batch) -> jax.stages.Lowered:
        return self._jitted.lower(model_params(model), router_bias, batch, self._qk_mult)


def _scalar(value: float, sharding: NamedSharding) -> Array:
    """An f32 scalar on `sharding`'s devices (every process gives the same value)."""
    return jax.make_array_from_callback((), sharding, lambda _: np.float32(value))


def compile_eval_step(recipe: Recipe, model_shardings, batch_sharding: NamedSharding) -> EvalStep:
    """The trainer's in-loop eval step: dropless (`dropless_recipe`)."""
    return EvalStep(dropless_recipe(recipe, batch_sharding.mesh.size), model_shardings, batch_sharding)


def evaluate(
    eval_step: Callable,
    model,
    router_bias: Array,
    loader,
    recipe: Recipe,
    batch_sharding: NamedSharding,
    *,
    process_index: int = 0,
    process_count: int = 1,
) -> dict[str, float]:
    """{"loss/<src>", "bpb/<src>", "tokens/<src>" per eval source, "macro_loss"} over `eval.batches`
    deterministic batches of each source (the same on every host; each host feeds its rows)."""
    batch_size = recipe.eval_rows
    per_host = batch_size // process_count
    rows = slice(process_index * per_host, (process_index + 1) * per_host)
    out: dict[str, float] = {}
    losses = []
    for source in recipe.eval.sources:
        total_ce, total_tokens = 0.0, 0.0
        for batch in loader.eval_batches(source, recipe.eval.batches, batch_size, recipe.train.seq_len):
            host = {k: v[rows] for k, v in batch.items()}
            ce, n = eval_step(model, router_bias, device_batch(host, batch_sharding, batch_size))
            total_ce, total_tokens = total_ce + float(ce), total_tokens + float(n)
        loss = total_ce / max(total_tokens, 1.0)
        out[f"loss/{source}"] = loss
        out[f"bpb/{source}"] = loss / math.log(2) / loader.bytes_per_token(source)
        out[f"tokens/{source}"] = total_tokens
        losses.append(loss)
    if losses:
        out["macro_loss"] = sum(losses) / len(losses)
    return out
