"""`model.remat = "offload"`: full remat whose saved block inputs wait out the forward in pinned host memory.

Its loss and gradients must be full remat's (tests/model/test_transformer.py checks "full" against no remat);
the only residual the layer scan keeps must be the [L, B, S, D] stack of block inputs, in host memory; and
the program lowered for a GPU must carry the host placement XLA offloads by. XLA:CPU lowers that placement
as a no-op, so the GPU lowering (cross-platform, nothing runs) is where the offload itself is visible here.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marinctl.model.loss import model_loss
from marinctl.model.transformer import init_model

KEY = jax.random.key(0, impl="rbg")  # RBG keys compile faster on CPU (tests/model/test_transformer.py)
B = 2


@pytest.fixture(scope="module")
def setup(small_recipe):
    rng = np.random.default_rng(7)
    S, V = small_recipe.train.seq_len, small_recipe.model.vocab_size
    tokens = rng.integers(0, V, size=(B, S + 1))
    seg = np.ones((B, S), np.int32)
    seg[0, S // 2 :] = 2  # two documents in row 0
    seg[-1, -3:] = 0  # padding
    batch = {
        "tokens": jnp.asarray(tokens[:, :-1]),
        "targets": jnp.asarray(tokens[:, 1:]),
        "segment_ids": jnp.asarray(seg),
        "loss_mask": jnp.asarray((seg != 0).astype(np.float32)),
    }
    bias = jnp.asarray(rng.normal(size=(small_recipe.model.num_layers, small_recipe.moe.num_experts)) * 0.1)
    model = init_model(small_recipe, KEY)
    # Non-zero SConv taps and attention gate, so every part of the block carries gradient.
    model = eqx.tree_at(
        lambda m: (m.blocks.sconv_keys.weight, m.blocks.sconv_mlp_out.weight, m.blocks.attention.w_gate),
        model,
        replace_fn=lambda w: jnp.asarray(rng.normal(size=w.shape).astype(np.float32) * 0.5),
    )
    return model, batch, bias


def _grad_fn(recipe, model, batch, bias, remat):
    params, static = eqx.partition(dataclasses.replace(model, remat=remat), eqx.is_array)

    def loss(p):
        return model_loss(eqx.combine(p, static), batch, bias, recipe)[0]

    return jax.value_and_grad(loss), params


def test_offload_gives_full_remats_loss_and_gradients(small_recipe, setup):
    out = {}
    for remat in ("full", "offload"):
        fn, params = _grad_fn(small_recipe, *setup, remat)
        loss, grads = jax.jit(fn)(params)
        out[remat] = (float(loss), jax.tree_util.tree_leaves(grads))
    # Bit for bit: the offload only moves the saved block inputs (a copy each way), and on CPU (the tests'
    # platform, tests/conftest.py) the placement lowers to nothing, so XLA compiles the same program.
    assert out["offload"][0] == out["full"][0]
    for g, g_ref in zip(out["offload"][1], out["full"][1], strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(g_ref))
    assert any(np.asarray(g).any() for g in out["offload"][1])


def _forward_scan_stacks(recipe, model, batch, bias, remat):
    """(shape, in host memory?) of each [L, ...] output of the forward layer scan that the scan's own
    result does not need: the residuals it stacks for the backward."""
    fn, params = _grad_fn(recipe, model, batch, bias, remat)
    jaxpr = jax.make_jaxpr(fn)(params).jaxpr
    scans = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    forward = scans[0]  # the layer scan, first in program order; the backward's scan comes after
    num_carry = forward.params["num_carry"]
    L = recipe.model.num_layers
    stacks = []
    for v in forward.outvars[num_carry:]:
        if v.aval.ndim >= 4 and v.aval.shape[0] == L:  # per-layer activations, not the [L] / [L, E] stats
            stacks.append((v.aval.shape, v.aval.memory_space == jax.memory.Space.Host))
    return stacks


def test_offload_stacks_only_the_block_inputs_and_stacks_them_in_host_memory(small_recipe, setup):
    L, S, D = small_recipe.model.num_layers, small_recipe.train.seq_len, small_recipe.model.hidden
    assert _forward_scan_stacks(small_recipe, *setup, "full") == [((L, B, S, D), False)]
    assert _forward_scan_stacks(small_recipe, *setup, "offload") == [((L, B, S, D), True)]


def test_offload_lowers_for_a_gpu_with_the_block_input_placed_in_pinned_host_memory(small_recipe, setup):
    S, D = small_recipe.train.seq_len, small_recipe.model.hidden
    placements = {}
    for remat in ("full", "offload"):
        fn, params = _grad_fn(small_recipe, *setup, remat)
        text = jax.jit(fn).trace(params).lower(lowering_platforms=("cuda",)).as_text()
        placements[remat] = [
            line.split("_xla_buffer_placement = ")[1].split('"')[1]
            for line in text.splitlines()
            if "annotate_device_placement" in line and "_xla_buffer_placement" in line
        ]
        if remat == "offload":  # one [B, S, D] block input out per layer in the forward, back in the backward
            shapes = {line.split(") -> ")[-1] for line in text.splitlines() if "annotate_device_placement" in line}
            assert shapes == {f"tensor<{B}x{S}x{D}xf32>"}, shapes
    assert placements["full"] == []
    assert sorted(placements["offload"]) == ["device", "pinned_host"]
