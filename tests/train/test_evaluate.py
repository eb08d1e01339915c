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


def _micro_eval_setup(recipe, seed: int):
    """The micro recipe's mesh, batch sharding, optimizer and state shardings on the test devices, and one
    host eval batch of random tokens."""
    import jax
    import numpy as np

    from marinctl.routing.mesh import batch_sharding, make_mesh
    from marinctl.train.state import make_optimizer, state_shardings

    mesh = make_mesh(recipe.parallel, jax.devices())
    optimizer = make_optimizer(recipe)
    shape = (recipe.eval_rows, recipe.train.seq_len)
    tokens = np.random.default_rng(seed).integers(0, recipe.model.vocab_size, shape, dtype=np.int32)
    host = {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1), "segment_ids": np.ones(shape, np.int32),
            "loss_mask": np.ones(shape, np.float32)}  # fmt: skip
    return mesh, batch_sharding(mesh), optimizer, state_shardings(recipe, optimizer, mesh), host


def test_a_train_transport_switch_and_a_new_qk_mult_keep_the_eval_program():
    """The run keys its eval programs by `eval_key`, so the hero's pooled -> ragged switch, and the eval at
    the first context after an extension raised `qk_mult`, reuse the eval step compiled before. The key may
    leave out only what the dropless program does not read: recipes with equal keys lower to the same
    program, and what it does read tells keys apart."""
    base = load_recipe(MICRO)
    n = 8
    switched = load_recipe(MICRO, ["moe.transport=pooled", "moe.capacity_factor=1.5", "moe.waves=2"])
    raised = load_recipe(MICRO, ["attention.qk_mult=1.5"])
    assert evaluate.eval_key(switched, n) == evaluate.eval_key(base, n) == evaluate.eval_key(raised, n)
    lowered = _lowered_eval(base)
    assert _lowered_eval(switched) == lowered == _lowered_eval(base, model_recipe=switched) == _lowered_eval(raised)
    assert _lowered_eval(load_recipe(MICRO, ["moe.router_weight_sum=2.0"])) != lowered  # the check bites
    for other in (["attention.qk_mult_learnable=true"], ["train.seq_len=64", "train.batch_size=4", "eval.batch_size=8"],
                  ["eval.batch_size=8"], ["moe.router_weight_sum=2.0"]):  # fmt: skip
        assert evaluate.eval_key(load_recipe(MICRO, other), n) != evaluate.eval_key(base, n), other


@pytest.mark.parametrize("learnable", [False, True])
def test_an_eval_step_at_another_qk_mult_equals_a_model_built_with_it(learnable):
    """`EvalStep.at` feeds another `qk_mult` to the program compiled for the first: its sums must equal a
    forward of the model built with that multiplier (the static config, as training runs it), and differ
    from the first multiplier's. With the learnable per-head factor the two multiply."""
    import jax
    import numpy as np

    from marinctl.model.loss import lm_loss
    from marinctl.model.transformer import build_model, model_params
    from marinctl.train.state import init_state
    from marinctl.train.step import device_batch

    extra = [f"attention.qk_mult_learnable={str(learnable).lower()}"]
    base, raised = load_recipe(MICRO, extra), load_recipe(MICRO, [*extra, "attention.qk_mult=1.7"])
    mesh, rows, optimizer, shardings, host = _micro_eval_setup(base, seed=1)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda: init_state(base, optimizer), out_shardings=shardings)()
        params = model_params(state.model)
        if learnable:  # a trained per-head factor, not its init of ones
            factor = params["blocks.attention.qk_mult"]
            params["blocks.attention.qk_mult"] = jax.numpy.linspace(0.8, 1.2, factor.size).reshape(factor.shape)
        model = build_model(base, params)
        batch = device_batch(host, rows, base.eval_rows)
        step = evaluate.compile_eval_step(base, shardings.model, rows)
        first, got = step(model, state.router_bias, batch), step.at(raised)(model, state.router_bias, batch)

        @jax.jit
        def reference(params, bias, batch):  # the static multiplier, as `eval_sums` was before it took one
            dropless = build_model(evaluate.dropless_recipe(raised, mesh.size), params)
            logits, _ = dropless(batch["tokens"], batch["segment_ids"], bias)
            return lm_loss(logits, batch["targets"], batch["loss_mask"], 0.0)[1]["ce"] * batch["loss_mask"].sum()

        want = reference(params, state.router_bias, batch)
    np.testing.assert_allclose(float(got[0]), float(want), rtol=1e-6)
    # The multiplier reached the model: at init its loss moves little (~7e-5), but 10x past the tolerance.
    assert abs(float(got[0]) - float(first[0])) > 1e-5 * abs(float(first[0]))


def test_an_eval_step_compiled_ahead_equals_the_one_compiled_at_its_first_call():
    """The precompile thread compiles later contexts' eval steps ahead (`EvalStep.compile`) from the
    abstract state alone; the executable must take the trainer's real state and batch and give
    the lazily jitted step's sums bit for bit."""
    import jax
    import numpy as np

    from marinctl.train.state import abstract_state, init_state, with_shardings
    from marinctl.train.step import device_batch

    recipe = load_recipe(MICRO)
    mesh, rows, optimizer, shardings, host = _micro_eval_setup(recipe, seed=0)
    shape = host["tokens"].shape
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
