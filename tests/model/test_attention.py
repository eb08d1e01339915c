"""Attention against a naive per-query masked-softmax loop in numpy (docs/recipe.md §2 attention, steps 1–8)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marinctl.errors import UserError
from marinctl.model.attention import (
    UNBOUNDED_WINDOW,
    Attention,
    LayerFacts,
    attention_mask,
    banded_attention,
    exclusive_self_attention,
    full_attention,
    fused_attention,
    kv_head_map,
    log_length_scale,
    masked_softmax_attention,
    rope,
    select_impl,
)
from marinctl.model.attention_blocks import causal_blocks, global_scores, local_scores
from marinctl.model.layers import ShortConv
from marinctl.recipe import AttentionConfig

B, S, H, Dh, D = 2, 12, 4, 8, 32
SEG = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 0, 0], [3] * 12])


def doc_positions(seg):
    pos = np.zeros_like(seg)
    for b in range(seg.shape[0]):
        for t in range(1, seg.shape[1]):
            pos[b, t] = pos[b, t - 1] + 1 if seg[b, t] == seg[b, t - 1] else 0
    return pos


def np_rms(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def np_rope(x, pos, rotary_dims, theta):
    """Split halves: dim i pairs with i + R/2, angle pos · θ^(−2i/R), as a complex rotation."""
    half = rotary_dims // 2
    out = x.copy()
    for i in range(half):
        angle = pos[:, :, None] * theta ** (-2 * i / rotary_dims)
        z = (x[..., i] + 1j * x[..., i + half]) * np.exp(1j * angle)
        out[..., i], out[..., i + half] = z.real, z.imag
    return out


def np_sconv(x, w, seg):
    out = np.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            for lag in range(w.shape[0]):
                if t - lag >= 0 and seg[b, t - lag] == seg[b, t]:
                    out[b, t] += w[lag] * x[b, t - lag]
    return out


def naive_attention(a, p, cfg, facts, sconv_k=None, sconv_v=None):
    """The SPEC written as loops: one query, one head at a time."""
    pos = doc_positions(SEG)
    q, k, v = a @ p["w_q"], a @ p["w_k"], a @ p["w_v"]
    if sconv_k is not None:
        k = np_sconv(k, sconv_k, SEG)
    if sconv_v is not None:
        v = np_sconv(v, sconv_v, SEG)
    q, k, v = q.reshape(B, S, H, Dh), k.reshape(B, S, -1, Dh), v.reshape(B, S, -1, Dh)
    if cfg.qk_norm:
        q, k = np_rms(q, cfg.qk_norm_eps), np_rms(k, cfg.qk_norm_eps)
    q = q * cfg.qk_mult * (p["qk_mult"][:, None] if "qk_mult" in p else 1.0)
    R = int(Dh * cfg.rope_fraction)
    if facts["rope"] and R:
        q, k = np_rope(q, pos, R, cfg.rope_theta), np_rope(k, pos, R, cfg.rope_theta)
    z = np.zeros((B, S, H, Dh))
    for b in range(B):
        for h in range(H):
            g = facts["kv_of_head"][h]
            for i in range(S):
                keys = [j for j in range(S) if j <= i and i - j < facts["window"] and SEG[b, j] == SEG[b, i]]
                scores = np.array([q[b, i, h] @ k[b, j, g] for j in keys]) / np.sqrt(Dh)
                w = np.exp(scores - scores.max())
                y = (w / w.sum()) @ v[b, keys, g]
                if cfg.xsa:
                    own = v[b, i, g]
                    y = y - (y @ own) / (own @ own + 1e-6) * own
                if "w_gate" in p:
                    y = y * 2 / (1 + np.exp(-(a[b, i] @ p["w_gate"][:, h])))
                z[b, i, h] = y
    return z.reshape(B, S, H * Dh) @ p["w_o"]


def make_facts(is_global, window, rope_on, kv):
    arrays = LayerFacts(
        is_global=jnp.asarray(is_global),
        window=jnp.asarray(window, jnp.int32),
        rope=jnp.asarray(rope_on),
        kv_of_head=jnp.asarray(kv_head_map(H, kv), jnp.int32),
    )
    return arrays, {"window": window, "rope": rope_on, "kv_of_head": kv_head_map(H, kv)}


def make_attention(cfg, stored_kv, seed=0):
    rng = np.random.default_rng(seed)
    p = {
        "w_q": rng.normal(size=(D, H * Dh)) * 0.3,
        "w_k": rng.normal(size=(D, stored_kv * Dh)) * 0.3,
        "w_v": rng.normal(size=(D, stored_kv * Dh)) * 0.3,
        "w_o": rng.normal(size=(H * Dh, D)) * 0.3,
    }
    if cfg.gate:
        p["w_gate"] = rng.normal(size=(D, H)) * 0.3
    if cfg.qk_mult_learnable:
        p["qk_mult"] = rng.uniform(0.5, 2.0, size=(H,))
    p = {n: w.astype(np.float32) for n, w in p.items()}
    module = Attention(
        **{n: jnp.asarray(w) for n, w in p.items()},
        **{n: None for n in ("w_gate", "qk_mult") if n not in p},
        config=cfg,
        num_heads=H,
        head_dim=Dh,
    )
    return module, p


BASE = AttentionConfig(local_kv_heads=2, global_kv_heads=1, window=4)
CASES = {
    # the hero's local layer: window, partial RoPE, 2 KV heads (GQA 2:1 here), SConv on keys
    "local": (BASE, 2, (False, 4, True, 2), True, False),
    # the hero's global layer: no window, NoPE, only the first of the 2 stored KV heads (GQA 4:1)
    "global": (BASE, 2, (True, UNBOUNDED_WINDOW, False, 1), True, False),
    # ablations: no QK norm, no XSA, no gate, full RoPE, learnable qk_mult, MHA, SConv on values
    "ablations": (
        dataclasses.replace(
            BASE,
            qk_norm=False,
            xsa=False,
            gate=False,
            rope_fraction=1.0,
            qk_mult_learnable=True,
            local_kv_heads=4,
            window=3,
        ),
        4,
        (False, 3, True, 4),
        False,
        True,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_attention_equals_naive_masked_softmax_loop(case):
    cfg, stored, (is_global, window, rope_on, kv), conv_keys, conv_values = CASES[case]
    module, p = make_attention(cfg, stored)
    facts, np_facts = make_facts(is_global, window, rope_on, kv)
    rng = np.random.default_rng(1)
    a = rng.normal(size=(B, S, D)).astype(np.float32)
    wk = rng.normal(size=(3, stored * Dh)).astype(np.float32) if conv_keys else None
    wv = rng.normal(size=(3, stored * Dh)).astype(np.float32) if conv_values else None
    out = eqx.filter_jit(module)(
        jnp.asarray(a),
        jnp.asarray(SEG),
        jnp.asarray(doc_positions(SEG)),
        facts,
        ShortConv(jnp.asarray(wk)) if conv_keys else None,
        ShortConv(jnp.asarray(wv)) if conv_values else None,
    )
    expected = naive_attention(a.astype(np.float64), p, cfg, np_facts, wk, wv)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-4, atol=2e-4)


def test_xsa_output_of_every_head_is_orthogonal_to_its_own_value_vector():
    cfg = dataclasses.replace(BASE, gate=False)
    module, p = make_attention(cfg, 2, seed=3)
    module = dataclasses.replace(module, w_o=jnp.eye(H * Dh))  # expose z = the merged heads
    facts, _ = make_facts(False, 4, True, 2)
    a = np.random.default_rng(4).normal(size=(B, S, D)).astype(np.float32)
    z = np.asarray(eqx.filter_jit(module)(jnp.asarray(a), jnp.asarray(SEG), jnp.asarray(doc_positions(SEG)), facts))
    z = z.reshape(B, S, H, Dh)
    v = (a @ p["w_v"]).reshape(B, S, 2, Dh)[:, :, kv_head_map(H, 2)]
    # The coefficient of z along v (1 for a document's first token before XSA, which sees only itself).
    along = np.sum(z * v, -1) / np.sum(v * v, -1)
    assert np.abs(along).max() < 1e-5
    without = dataclasses.replace(module, config=dataclasses.replace(cfg, xsa=False))
    z_plain = np.asarray(
        eqx.filter_jit(without)(jnp.asarray(a), jnp.asarray(SEG), jnp.asarray(doc_positions(SEG)), facts)
    )
    assert np.abs(np.sum(z_plain.reshape(B, S, H, Dh) * v, -1) / np.sum(v * v, -1)).mean() > 0.1


def test_partial_rope_rotates_only_the_first_half_of_each_head():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 7, 3, 16)).astype(np.float32)
    pos = rng.integers(0, 5000, size=(2, 7))
    out = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), 8, 10000.0, jnp.asarray(True)))
    np.testing.assert_array_equal(out[..., 8:], x[..., 8:])
    np.testing.assert_allclose(out, np_rope(x.astype(np.float64), pos, 8, 10000.0), rtol=1e-4, atol=1e-4)
    off = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos), 8, 10000.0, jnp.asarray(False)))
    np.testing.assert_array_equal(off, x)


def autodiff_rope(x, pos, rotary_dims, theta, on):
    """The rope this module had before its custom backward: the same forward, differentiated by JAX."""
    half = rotary_dims // 2
    angle = pos.astype(jnp.float32)[..., None] * theta ** (-jnp.arange(half, dtype=jnp.float32) * 2.0 / rotary_dims)
    cos = jnp.where(on, jnp.cos(angle), 1.0)[:, :, None, :]
    sin = jnp.where(on, jnp.sin(angle), 0.0)[:, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:rotary_dims].astype(jnp.float32)
    r1, r2 = (x1 * cos - x2 * sin).astype(x.dtype), (x2 * cos + x1 * sin).astype(x.dtype)
    return jnp.concatenate([r1, r2, x[..., rotary_dims:]], axis=-1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rope_value_and_gradient_equal_autodiffs_bit_for_bit(dtype):
    """rope's hand-written backward (a rotation by −angle) against JAX's transpose of the forward, compiled,
    for a traced on/off flag as the layer scan passes it."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.normal(size=(2, 33, 3, 16)), dtype)
    cot = jnp.asarray(rng.normal(size=x.shape), dtype)
    pos = jnp.asarray(rng.integers(0, 5000, size=(2, 33)))

    def value_and_grad(f):
        return jax.jit(lambda x, on: (lambda y, vjp: (y, vjp(cot)[0]))(*jax.vjp(lambda x: f(x, pos, 8, 1e4, on), x)))

    bits = lambda a: np.asarray(a.astype(jnp.float32)).view(np.int32)  # noqa: E731
    for on in (True, False):
        got, want = value_and_grad(rope)(x, jnp.asarray(on)), value_and_grad(autodiff_rope)(x, jnp.asarray(on))
        assert got[1].dtype == x.dtype
        np.testing.assert_array_equal(bits(got[0]), bits(want[0]))
        np.testing.assert_array_equal(bits(got[1]), bits(want[1]))


def test_global_layers_carry_no_position_while_local_layers_do():
    module, _ = make_attention(BASE, 2, seed=6)
    a = jnp.asarray(np.random.default_rng(7).normal(size=(B, S, D)).astype(np.float32))
    seg = jnp.asarray(SEG)
    pos = doc_positions(SEG)
    scrambled = np.random.default_rng(8).permutation(pos.T).T * 37  # any other positions
    for is_global, window, rope_on, kv in ((True, UNBOUNDED_WINDOW, False, 1), (False, 4, True, 2)):
        facts, _ = make_facts(is_global, window, rope_on, kv)
        call = eqx.filter_jit(module)
        first = np.asarray(call(a, seg, jnp.asarray(pos), facts))
        second = np.asarray(call(a, seg, jnp.asarray(scrambled), facts))
        if is_global:
            np.testing.assert_array_equal(first, second)
        else:
            assert np.abs(first - second).max() > 1e-3


def test_fused_attention_call_matches_the_plain_path():
    """The cuDNN path's argument layout and mask, run through jax.nn's XLA implementation on CPU."""
    rng = np.random.default_rng(9)
    q, k, v = (jnp.asarray(rng.normal(size=(B, S, H, Dh)).astype(np.float32)) for _ in range(3))
    for window in (3, UNBOUNDED_WINDOW):
        mask = attention_mask(jnp.asarray(SEG), jnp.asarray(window))
        plain = jax.jit(masked_softmax_attention)(q, k, v, mask)
        fused = jax.jit(fused_attention, static_argnums=4)(q, k, v, mask, "xla")
        np.testing.assert_allclose(np.asarray(fused), np.asarray(plain), rtol=1e-5, atol=1e-5)


def test_cudnn_is_never_selected_on_cpu():
    assert select_impl("auto", jnp.bfloat16) == "xla"
    assert select_impl("xla", jnp.float32) == "xla"
    with pytest.raises(UserError, match=r"attention\.impl"):
        select_impl("cudnn", jnp.bfloat16)


def test_log_length_scale_is_one_up_to_65k_then_squared_log_growth():
    pos = jnp.asarray([[0, 65535, 131071, 262143]])
    np.testing.assert_allclose(np.asarray(log_length_scale(pos))[0], [1.0, 1.0, 1.1434, 1.2965], atol=1e-4)


# ---------------------------------------------------------------------------------------------------
# The banded (local) and full (global) paths against the masked-softmax path with K/V gathered per head.


def oracle(q, k, v, seg, window):
    """The previous XLA path: every query head's KV head gathered, the full S×S mask."""
    idx = jnp.asarray(kv_head_map(q.shape[2], k.shape[2]))
    mask = attention_mask(seg, jnp.asarray(window))
    return masked_softmax_attention(q, jnp.take(k, idx, 2), jnp.take(v, idx, 2), mask)


def oracle_core(q, k, v, mask):
    return masked_softmax_attention(q, k, v, mask)


def qkv(seq, kv, seed=0, batch=2, heads=4, dh=8):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(batch, seq, heads, dh)) * 1.5  # peaked softmax: a mask error shows
    k = rng.normal(size=(batch, seq, kv, dh))
    v = rng.normal(size=(batch, seq, kv, dh))
    return tuple(jnp.asarray(x.astype(np.float32)) for x in (q, k, v))


def packed_segments(seq, batch=2, seed=0):
    """Documents of random lengths (some shorter than the window, some longer) and trailing padding."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        t, doc = 0, 1
        while t < seq - 2:
            n = int(rng.integers(1, seq // 2 + 2))
            seg[b, t : t + n] = doc
            t, doc = t + n, doc + 1
        seg[b, -2:] = 0 if b == 0 else seg[b, -3]  # row 0 ends in padding
    return jnp.asarray(seg)


SLOW = pytest.mark.slow
BANDED_CASES = [  # (seq, kv heads, window bound, traced window, block); the unmarked four are the key proofs
    pytest.param((23, 2, 5, 5, None), id="window does not divide seq"),
    pytest.param((23, 1, 7, 7, 3), id="small blocks, 3+ key blocks"),
    pytest.param((23, 2, 8, 5, None), id="traced window below the bound"),
    pytest.param((12, 1, 64, 64, None), id="window > seq (full fallback)"),
    pytest.param((16, 2, 4, 4, None), id="window divides seq", marks=SLOW),
    pytest.param((29, 2, 4, 4, 8), id="block larger than window", marks=SLOW),
    pytest.param((9, 2, 1, 1, None), id="window 1 (only itself)", marks=SLOW),
    pytest.param((12, 2, 12, 12, None), id="window = seq", marks=SLOW),
    pytest.param((150, 2, 64, 64, None), id="default block at W >= 64", marks=SLOW),
]


@pytest.mark.parametrize("case", BANDED_CASES)
def test_banded_attention_and_its_gradients_equal_the_masked_softmax_oracle(case):
    seq, kv, bound, window, block = case
    q, k, v = qkv(seq, kv)
    seg = packed_segments(seq)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=q.shape).astype(np.float32))

    def run(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(cot)

    banded = jax.jit(lambda q, k, v: banded_attention(q, k, v, seg, jnp.asarray(window), bound, block))
    out, grads = run(banded)
    ref, ref_grads = run(jax.jit(lambda q, k, v: oracle(q, k, v, seg, window)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [3, UNBOUNDED_WINDOW])
def test_full_attention_with_broadcast_kv_equals_the_gathered_oracle(window):
    q, k, v = qkv(17, 2, seed=2)
    seg = packed_segments(17, seed=3)
    out = jax.jit(lambda q, k, v: full_attention(q, k, v, seg, jnp.asarray(window)))(q, k, v)
    np.testing.assert_allclose(np.asarray(out), np.asarray(oracle(q, k, v, seg, window)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "seq, kv, window, blocks",
    [(23, 2, UNBOUNDED_WINDOW, 3), (24, 1, UNBOUNDED_WINDOW, 4), (17, 2, 5, 2), (256, 2, UNBOUNDED_WINDOW, None)],
    ids=["blocks do not divide seq", "one KV head", "window inside the blocks", "default blocks at S=256"],
)
def test_causal_blocked_full_attention_and_its_gradients_equal_the_masked_softmax_oracle(seq, kv, window, blocks):
    """The global path skips the key blocks above the diagonal; value and gradients equal the full square's."""
    q, k, v = qkv(seq, kv, seed=5)
    seg = packed_segments(seq, seed=6)
    cot = jnp.asarray(np.random.default_rng(7).normal(size=q.shape).astype(np.float32))

    def run(fn):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(cot)

    out, grads = run(jax.jit(lambda q, k, v: full_attention(q, k, v, seg, jnp.asarray(window), blocks)))
    ref, ref_grads = run(jax.jit(lambda q, k, v: oracle(q, k, v, seg, window)))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_causal_blocks_skip_the_upper_triangle_at_training_lengths():
    assert [causal_blocks(s) for s in (128, 255, 256, 512, 1024, 4096)] == [1, 1, 4, 4, 8, 8]
    seq = 512
    q, k, v = qkv(seq, 1, batch=1)
    seg = jnp.ones((1, seq), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda q, k, v: full_attention(q, k, v, seg, jnp.asarray(UNBOUNDED_WINDOW)))(q, k, v)
    scores = [e.aval.shape for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "dot_general" for e in eqn.outvars]
    key_lengths = sorted(shape[-1] for shape in scores if shape[-1] != 8)  # [b, h, q, keys]; 8 = head_dim
    assert key_lengths == [128, 256, 384, 512]  # 10 of 16 blocks of the square


@pytest.mark.parametrize(("seq", "window"), [(512, 64), (200, 64), (1024, 256), (96, 16), (64, 64), (128, 8)])
def test_the_planners_score_counts_are_the_scores_each_path_computes(seq, window):
    """`global_scores` / `local_scores` (what marinctl.counting's planner counts) equal the score elements of
    the dot products the two paths run, per query head and sequence, padding to whole blocks included."""
    heads, kv = 4, 2
    q, k, v = qkv(seq, kv, batch=1, heads=heads)
    seg = jnp.ones((1, seq), jnp.int32)

    def scores(fn):
        jaxpr = jax.make_jaxpr(fn)(q, k, v)
        outs = [e.aval.shape for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "dot_general" for e in eqn.outvars]
        return sum(int(np.prod(shape)) for shape in outs if shape[-1] != 8) // heads  # 8 = head_dim: P·V

    full = scores(lambda q, k, v: full_attention(q, k, v, seg, jnp.asarray(UNBOUNDED_WINDOW)))
    band = scores(lambda q, k, v: banded_attention(q, k, v, seg, jnp.asarray(window), window))
    assert full == global_scores(seq)
    assert band == local_scores(seq, window)


def test_banded_attention_never_builds_a_sequence_squared_score_matrix():
    seq, window = 512, 64
    q, k, v = qkv(seq, 2, batch=1)
    seg = jnp.ones((1, seq), jnp.int32)

    def largest(fn):
        jaxpr = jax.make_jaxpr(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2), argnums=(0, 1, 2)))(q, k, v)
        return max(int(np.prod(e.aval.shape)) for eqn in jaxpr.jaxpr.eqns for e in eqn.outvars)

    band = largest(lambda q, k, v: banded_attention(q, k, v, seg, jnp.asarray(window), window))
    full = largest(lambda q, k, v: oracle(q, k, v, seg, window))
    assert full == 4 * seq * seq  # [1, heads, S, S]
    assert band == 4 * seq * (window // 2 + window)  # blocks of W/2 queries x 1.5 W keys


def test_xsa_on_grouped_values_equals_xsa_on_values_gathered_per_head():
    rng = np.random.default_rng(4)
    y = jnp.asarray(rng.normal(size=(2, 5, 4, 8)).astype(np.float32))
    v = jnp.asarray(rng.normal(size=(2, 5, 2, 8)).astype(np.float32))
    gathered = jnp.take(v, jnp.asarray(kv_head_map(4, 2)), axis=2)
    np.testing.assert_allclose(
        np.asarray(exclusive_self_attention(y, v)), np.asarray(exclusive_self_attention(y, gathered)), atol=1e-6
    )


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_xsa_and_its_gradients_equal_a_float64_reference(kv_heads):
    """XSA's own paths (one KV head broadcast as it is, several grouped) against the §2.6 formula in float64,
    each head reading its KV head through `kv_head_map`; the gradients through jax.grad against float64 JAX
    autodiff of the per-head formula."""
    rng = np.random.default_rng(5)
    y = rng.normal(size=(2, 6, 4, 8))
    v = rng.normal(size=(2, 6, kv_heads, 8))
    w = rng.normal(size=y.shape)
    heads = np.asarray(kv_head_map(4, kv_heads))

    def reference(y, v):
        vh = v[:, :, heads]
        coef = (y * vh).sum(-1, keepdims=True) / ((vh * vh).sum(-1, keepdims=True) + 1e-6)
        return y - coef * vh

    def loss(fn, y, v):
        return jnp.sum(fn(y, v) * w)

    f32 = [jnp.asarray(t, jnp.float32) for t in (y, v)]
    np.testing.assert_allclose(np.asarray(exclusive_self_attention(*f32)), reference(y, v), rtol=1e-5, atol=1e-5)
    with jax.enable_x64():
        want = jax.grad(lambda y, v: loss(reference, y, v), argnums=(0, 1))(jnp.asarray(y), jnp.asarray(v))
    got = jax.grad(lambda y, v: loss(exclusive_self_attention, y, v), argnums=(0, 1))(*f32)
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("is_global", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_attention_module_gradients_equal_the_gathered_full_square_path(is_global, monkeypatch):
    """The whole module (QK norm, partial RoPE, SConv, XSA, gate) under the layer-kind `lax.cond`, against
    the previous path: K/V gathered per head, the full S×S mask, XSA on the gathered values (the module's
    cuDNN branch with the plain masked softmax standing in for cuDNN); scanned like the model's layers."""
    import marinctl.model.attention as attention_module

    monkeypatch.setattr(attention_module, "fused_attention", lambda q, k, v, mask, impl: oracle_core(q, k, v, mask))
    cfg = dataclasses.replace(BASE, window=5)
    module, _ = make_attention(cfg, 2, seed=11)
    S2 = 23
    seg = packed_segments(S2, seed=5)
    pos = jnp.asarray(doc_positions(np.asarray(seg)))
    kv = 1 if is_global else 2
    window = UNBOUNDED_WINDOW if is_global else 5
    facts, _ = make_facts(is_global, window, not is_global, kv)
    a = jnp.asarray(np.random.default_rng(6).normal(size=(B, S2, D)).astype(np.float32))
    conv = ShortConv(jnp.asarray(np.random.default_rng(7).normal(size=(3, 2 * Dh)).astype(np.float32)))

    def loss(m, a, reference):
        def body(x, f):  # a one-layer scan: the cond's predicate is traced as in the model
            return x, m(a, seg, pos, f, conv, None, "reference" if reference else "xla")

        _, y = jax.lax.scan(body, 0.0, jax.tree_util.tree_map(lambda x: x[None], facts))
        return jnp.sum(jnp.sin(y))

    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    val, g = grad(module, a, False)
    ref_val, ref_g = grad(module, a, True)
    assert float(val) == pytest.approx(float(ref_val), rel=1e-5)
    for x, r in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(ref_g), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(r), rtol=1e-4, atol=1e-5)
