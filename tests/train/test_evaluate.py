"""Which dropless transport evaluation and inference pick (the numbers themselves: tests/stages/test_eval.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import marinctl.train.evaluate as evaluate
from marinctl.recipe import load_recipe

MICRO = Path(__file__).resolve().parents[1] / "micro.toml"  # top-2 of 8 experts


@pytest.mark.parametrize(
    ("experts", "top_k", "dense_bytes", "want"),
    [
        (8, 2, evaluate.DENSE_EVAL_BYTES, "ragged"),  # dense would do 4x the routed expert work
        (16, 4, evaluate.DENSE_EVAL_BYTES, "ragged"),  # the tiny recipe's
        (4, 2, evaluate.DENSE_EVAL_BYTES, "dense"),  # 2x: dense while it is small
        (4, 2, 1, "ragged"),  # ... and ragged once dense's intermediate would not fit
    ],
)
def test_eval_and_inference_use_ragged_where_dense_does_more_than_twice_the_routed_work(
    experts, top_k, dense_bytes, want, monkeypatch
):
    from marinctl.export import inference_recipe

    monkeypatch.setattr(evaluate, "DENSE_EVAL_BYTES", dense_bytes)
    recipe = load_recipe(MICRO, [f"moe.num_experts={experts}", f"moe.top_k={top_k}", "moe.ragged_buffer_factor=1.25"])
    assert evaluate.eval_transport(recipe, 1) == want
    assert inference_recipe(recipe, 64).moe.transport == want  # a short call too
    dropless = evaluate.dropless_recipe(recipe, 1).moe
    assert dropless.transport == want and dropless.ragged_buffer_factor is None  # ragged unbounded: no drops


def _lowered_eval(recipe, model_recipe=None) -> str:
    """The eval step's StableHLO for `recipe` on the test devices, called on the model of `model_recipe`'s
    segment (as the trainer calls the step it compiled first on every later segment's model)."""
    import jax

    from marinctl.routing.mesh import batch_sharding, make_mesh
    from marinctl.train.state import abstract_state, make_optimizer, state_shardings, with_shardings
    from marinctl.train.step import batch_spec

    mesh = make_mesh(recipe.parallel, jax.devices())
    rows = batch_sharding(mesh)
    step_shardings = state_shardings(recipe, make_optimizer(recipe), mesh)
    model_recipe = model_recipe or recipe
    optimizer = make_optimizer(model_recipe)
    state = with_shardings(abstract_state(model_recipe, optimizer), state_shardings(model_recipe, optimizer, mesh))
    with jax.set_mesh(mesh):
        step = evaluate.compile_eval_step(recipe, step_shardings.model, rows)
        return step.lower(state.model, state.router_bias, batch_spec(recipe, rows, recipe.eval_rows)).as_text()


def test_a_train_transport_switch_keeps_the_eval_program():
    """The run keys its eval programs by `eval_key`, so the hero's pooled -> ragged switch reuses the
    eval step compiled before it. The key may leave out only what the dropless program does not read:
    recipes with equal keys lower to the same program, and what it does read tells keys apart."""
    base = load_recipe(MICRO)
    n = 8
    switched = load_recipe(MICRO, ["moe.transport=pooled", "moe.capacity_factor=1.5", "moe.waves=2"])
    assert evaluate.eval_key(switched, n) == evaluate.eval_key(base, n)
    assert _lowered_eval(switched) == _lowered_eval(base) == _lowered_eval(base, model_recipe=switched)
    assert _lowered_eval(load_recipe(MICRO, ["attention.qk_mult=1.5"])) != _lowered_eval(base)  # the check bites
    for other in (["attention.qk_mult=1.5"], ["train.seq_len=64", "train.batch_size=4", "eval.batch_size=8"],
                  ["eval.batch_size=8"], ["moe.router_weight_sum=2.0"]):  # fmt: skip
        assert evaluate.eval_key(load_recipe(MICRO, other), n) != evaluate.eval_key(base, n), other


def test_an_eval_step_compiled_ahead_equals_the_one_compiled_at_its_first_call():
    """The precompile thread compiles later contexts' eval steps ahead (`EvalStep.compile`) from the
    abstract state alone; the executable must take the trainer's real state and batch and give
    the lazily jitted step's sums bit for bit."""
    import jax
    import numpy as np

    from marinctl.routing.mesh import batch_sharding, make_mesh
    from marinctl.train.state import abstract_state, init_state, make_optimizer, state_shardings, with_shardings
    from marinctl.train.step import device_batch

    recipe = load_recipe(MICRO)
    mesh = make_mesh(recipe.parallel, jax.devices())
    rows = batch_sharding(mesh)
    optimizer = make_optimizer(recipe)
    shardings = state_shardings(recipe, optimizer, mesh)
    shape = (recipe.eval_rows, recipe.train.seq_len)
    tokens = np.random.default_rng(0).integers(0, recipe.model.vocab_size, shape, dtype=np.int32)
    host = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "segment_ids": np.ones(shape, np.int32),
            "loss_mask": np.ones(shape, np.float32)}  # fmt: skip
    with jax.set_mesh(mesh):
        state = jax.jit(lambda: init_state(recipe, optimizer), out_shardings=shardings)()
        n_bias = state.router_bias.size
        bias = state.router_bias + jax.numpy.linspace(-0.1, 0.1, n_bias).reshape(state.router_bias.shape)
        batch = device_batch(host, rows, recipe.eval_rows)
        abstract = with_shardings(abstract_state(recipe, optimizer), shardings)
        ahead = evaluate.compile_eval_step(recipe, shardings.model, rows).compile(abstract.model, abstract.router_bias)
        assert isinstance(ahead._call, jax.stages.Compiled)  # compiled before any call
        lazy = evaluate.compile_eval_step(recipe, shardings.model, rows)
        got, want = ahead(state.model, bias, batch), lazy(state.model, bias, batch)
    assert float(want[1]) == shape[0] * shape[1]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
