"""Cross-entropy and the logit z-loss against numpy; masked tokens never count."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from marinctl.model.loss import chunk_length, chunked_lm_loss, lm_loss

RNG = np.random.default_rng(0)
B, S, V = 2, 7, 11


def np_loss(logits, targets, mask, weight):
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    target = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    n = mask.sum()
    return ((lse - target) * mask).sum() / n, weight * (lse**2 * mask).sum() / n


def test_cross_entropy_and_z_loss_equal_numpy_over_unmasked_tokens():
    logits = (RNG.normal(size=(B, S, V)) * 5 + 20).astype(np.float32)  # large lse: z-loss matters
    targets = RNG.integers(0, V, size=(B, S))
    mask = (RNG.uniform(size=(B, S)) > 0.3).astype(np.float32)
    loss, parts = jax.jit(lm_loss, static_argnums=3)(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask), 1e-4)
    ce, z = np_loss(logits.astype(np.float64), targets, mask, 1e-4)
    np.testing.assert_allclose(float(parts["ce"]), ce, rtol=1e-5)
    np.testing.assert_allclose(float(parts["z_loss"]), z, rtol=1e-5)
    np.testing.assert_allclose(float(loss), ce + z, rtol=1e-5)


def test_padding_and_masked_targets_change_neither_loss_nor_gradient():
    logits = RNG.normal(size=(B, S, V)).astype(np.float32)
    targets = RNG.integers(0, V, size=(B, S))
    mask = np.ones((B, S), np.float32)
    mask[0, 4:] = 0  # padding
    mask[1, 2] = 0  # a cross-document target
    grad_fn = jax.jit(jax.value_and_grad(lambda lg, t, m: lm_loss(lg, t, m, 1e-4)[0]))
    loss, grad = grad_fn(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
    noisy, bad_targets = logits.copy(), targets.copy()
    noisy[mask == 0] = RNG.normal(size=((mask == 0).sum(), V)) * 100
    bad_targets[mask == 0] = -1  # any pad id, even out of range
    loss2, grad2 = grad_fn(jnp.asarray(noisy), jnp.asarray(bad_targets), jnp.asarray(mask))
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad2)[mask == 1], np.asarray(grad)[mask == 1], rtol=1e-6)
    assert np.all(np.asarray(grad2)[mask == 0] == 0)


# ---------------------------------------------------------------------------------------------------
# The chunked lm_head + loss (model.ce_chunk_tokens) against the full-logits path it replaces.

Bc, Sc, Dc, Vc = 3, 22, 16, 37


def _chunk_inputs(seed=1):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(Bc, Sc, Dc)).astype(np.float32)
    w = (rng.normal(size=(Dc, Vc)) * 2).astype(np.float32)  # logits ~ N(0, 64): lse large, z-loss matters
    targets = rng.integers(0, Vc, size=(Bc, Sc))
    mask = (rng.uniform(size=(Bc, Sc)) > 0.25).astype(np.float32)
    mask[0, 15:] = 0  # trailing padding
    targets[mask == 0] = -1  # pad ids, out of range
    return jnp.asarray(h), jnp.asarray(w), jnp.asarray(targets), jnp.asarray(mask)


def _full(h, w, targets, mask, weight):
    return lm_loss(jnp.einsum("bsd,dv->bsv", h, w), targets, mask, weight)


@pytest.mark.parametrize("chunk_tokens", [3, 12, 33, 66, 0])  # ragged (22 = 7·3 + 1), 4 rows, uneven, one chunk, off
def test_chunked_loss_and_gradients_equal_the_full_logits_path(chunk_tokens):
    h, w, targets, mask = _chunk_inputs()
    weight = 1e-2

    def full(h, w):
        return _full(h, w, targets, mask, weight)

    def chunked(h, w):
        return chunked_lm_loss(h, w, targets, mask, weight, chunk_tokens)

    (loss, parts), grads = jax.jit(jax.value_and_grad(full, argnums=(0, 1), has_aux=True))(h, w)
    (closs, cparts), cgrads = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1), has_aux=True))(h, w)
    assert float(parts["z_loss"]) > 0.1 * float(parts["ce"])  # the z-loss term is exercised
    for name in ("ce", "z_loss"):
        np.testing.assert_allclose(float(cparts[name]), float(parts[name]), rtol=1e-5)
    np.testing.assert_allclose(float(closs), float(loss), rtol=1e-5)
    for g, cg in zip(grads, cgrads, strict=True):
        np.testing.assert_allclose(np.asarray(cg), np.asarray(g), rtol=1e-4, atol=1e-6 * float(np.abs(g).max()))
    assert np.all(np.asarray(cgrads[0])[np.asarray(mask) == 0] == 0)  # padding gets no gradient


def _avals(jaxpr):
    """Every intermediate array shape in a jaxpr, nested jaxprs (scan, checkpoint, pjit) included."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield var.aval.shape
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _avals(inner)


def test_chunked_gradient_never_builds_more_than_one_chunk_of_logits():
    h, w, targets, mask = _chunk_inputs()
    chunk_tokens = 12  # 4 positions x 3 rows

    def grad_of(fn):
        return jax.make_jaxpr(jax.grad(fn, argnums=(0, 1)))(h, w).jaxpr

    def vocab_sized(jaxpr):
        return max(int(np.prod(s)) for s in _avals(jaxpr) if s and s[-1] == Vc and s != (Dc, Vc))

    assert vocab_sized(grad_of(lambda h, w: _full(h, w, targets, mask, 1e-4)[0])) == Bc * Sc * Vc
    chunked = grad_of(lambda h, w: chunked_lm_loss(h, w, targets, mask, 1e-4, chunk_tokens)[0])
    assert vocab_sized(chunked) == Bc * chunk_length(Bc, Sc, chunk_tokens) * Vc == chunk_tokens * Vc


def test_chunk_length_counts_tokens_per_device_under_a_batch_sharded_mesh():
    assert chunk_length(16, 4096, 8192) == 512
    assert chunk_length(16, 4096, 0) == 4096
    assert chunk_length(16, 100, 8192) == 100
    mesh = jax.make_mesh((1, 4, 2), ("replica", "data", "expert"), axis_types=(AxisType.Auto,) * 3)
    with jax.set_mesh(mesh):
        assert chunk_length(16, 4096, 8192) == 4096  # 2 rows per device
        assert chunk_length(12, 4096, 8192) == 682  # 12 rows do not split 8 ways: unsharded


@pytest.mark.slow  # two model compiles; the chunked math itself is proven above, unmarked
def test_model_loss_with_chunked_cross_entropy_equals_full_logits(small_recipe):
    """The wiring: `Transformer.features` + the chunked lm_head equal `model(...)` logits + `lm_loss`."""
    import dataclasses

    import equinox as eqx

    from marinctl.model.loss import model_loss
    from marinctl.model.transformer import init_model

    S, V, E = small_recipe.train.seq_len, small_recipe.model.vocab_size, small_recipe.moe.num_experts
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, V, size=(2, S + 1))
    seg = np.ones((2, S), np.int32)
    seg[1, -3:] = 0
    batch = {
        "tokens": jnp.asarray(tokens[:, :-1]),
        "targets": jnp.asarray(tokens[:, 1:]),
        "segment_ids": jnp.asarray(seg),
        "loss_mask": jnp.asarray((seg != 0).astype(np.float32)),
    }
    model, bias = init_model(small_recipe, jax.random.key(0)), jnp.zeros((2, E))
    out = {}
    for chunk in (0, 6):  # 0: the full-logits path; 6 tokens = 3 positions x 2 rows, 16 = 5·3 + 1 (ragged)
        recipe = small_recipe.replace(model=dataclasses.replace(small_recipe.model, ce_chunk_tokens=chunk))
        fn = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, b, r=recipe: model_loss(m, b, bias, r), has_aux=True))
        (loss, aux), grads = fn(model, batch)
        out[chunk] = float(loss), float(aux["z_loss"]), jax.tree_util.tree_leaves(grads)
    assert out[6][0] == pytest.approx(out[0][0], rel=1e-6)
    assert out[6][1] == pytest.approx(out[0][1], rel=1e-5)
    for g, ref in zip(out[6][2], out[0][2], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-4, atol=1e-7)
