"""Transports (docs/recipe.md §4) on 8 simulated CPU devices, against plain-numpy oracles of the same rules."""

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

from marinctl.errors import UserError
from marinctl.recipe import MoEConfig
from marinctl.routing.transports import (
    _capacity,
    _chunk_sizes,
    _linear,
    _ragged_all_to_all_emulated,
    _Shard,
    _take,
    _tile_groups,
    _tile_slots,
    _tiled_swiglu,
    get_transport,
    ragged_buffer_rows,
    ragged_transport,
)

T, E, K, LATENT, WIDTH = 256, 16, 4, 16, 24
AXES = ("replica", "data", "expert")
MESHES = [(1, 2, 4), (1, 1, 8), (1, 8, 1), (2, 1, 4)]
# Compile time dominates these tests; LLVM's optimizations are not what they check (halves their time).
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def mesh_of(shape):
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 3)


def problem(seed: int, skew: float = 0.0):
    """Random latent rows, distinct top-K experts per token (probability ∝ exp(-skew·e)), ~20% padding."""
    rng = np.random.default_rng(seed)
    p = np.exp(-skew * np.arange(E))
    p /= p.sum()
    return {
        "u": rng.normal(size=(T, LATENT)).astype(np.float32),
        "expert_idx": np.stack([rng.choice(E, K, replace=False, p=p) for _ in range(T)]).astype(np.int32),
        "combine": rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32),
        "valid": rng.random(T) > 0.2,
        "w_gate": (rng.normal(size=(E, LATENT, WIDTH)) / 4).astype(np.float32),
        "w_up": (rng.normal(size=(E, LATENT, WIDTH)) / 4).astype(np.float32),
        "w_down": (rng.normal(size=(E, WIDTH, LATENT)) / 4).astype(np.float32),
    }


def numpy_moe(x, keep):
    """y[t] = Σ_k combine·SwiGLU_e(u[t]) over assignments with keep[t,k], in float64 loops."""
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    y = np.zeros((T, LATENT))
    for t in range(T):
        for k in range(K):
            if keep[t, k]:
                e, u = x["expert_idx"][t, k], x["u"][t].astype(np.float64)
                h = silu(u @ x["w_gate"][e]) * (u @ x["w_up"][e])
                y[t] += x["combine"][t, k] * (h @ x["w_down"][e])
    return y


def run(name: str, x, moe: MoEConfig, mesh_shape=None, transport=None):
    """Forward output, stats and gradients w.r.t. (u, combine, w_gate, w_up, w_down), jitted under the mesh."""
    fn = transport or get_transport(name)
    probe = jnp.sin(jnp.arange(LATENT, dtype=jnp.float32))

    def loss(u, combine, w_gate, w_up, w_down):
        y, stats = fn(u, x["expert_idx"], combine, x["valid"], w_gate, w_up, w_down, moe)
        return jnp.sum(y * probe), (y, stats)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True), compiler_options=FAST_COMPILE)
    args = (x["u"], x["combine"], x["w_gate"], x["w_up"], x["w_down"])
    if mesh_shape is None:
        (_, (y, stats)), grads = step(*args)
    else:
        with jax.set_mesh(mesh_of(mesh_shape)):
            (_, (y, stats)), grads = step(*args)
    return np.asarray(y), {k: np.asarray(v) for k, v in stats.items()}, [np.asarray(g) for g in grads]


@pytest.fixture(scope="module")
def uniform():
    return problem(0)


@pytest.fixture(scope="module")
def dense_reference(uniform):
    return run("dense", uniform, MoEConfig(num_experts=E, top_k=K))


def test_dense_equals_numpy_loop_over_selected_experts(uniform, dense_reference):
    y, stats, _ = dense_reference
    keep = np.broadcast_to(uniform["valid"][:, None], (T, K))
    np.testing.assert_allclose(y, numpy_moe(uniform, keep), atol=2e-5)
    load = np.bincount(uniform["expert_idx"][uniform["valid"]].ravel(), minlength=E)
    np.testing.assert_array_equal(stats["expert_load"], load)
    assert stats["assignments"] == K * uniform["valid"].sum()
    assert stats["sender_drops"] == stats["receiver_drops"] == 0
    assert np.all(y[~uniform["valid"]] == 0)


def test_dense_gradients_equal_a_naive_gather_implementation(uniform, dense_reference):
    x = uniform

    def naive(u, combine, w_gate, w_up, w_down):
        y = 0.0
        for k in range(K):
            e = x["expert_idx"][:, k]
            h = jax.nn.silu(jnp.einsum("tl,tli->ti", u, w_gate[e])) * jnp.einsum("tl,tli->ti", u, w_up[e])
            y = y + (combine[:, k] * x["valid"])[:, None] * jnp.einsum("ti,til->tl", h, w_down[e])
        return jnp.sum(y * jnp.sin(jnp.arange(LATENT, dtype=jnp.float32)))

    grads = jax.grad(naive, argnums=(0, 1, 2, 3, 4))(x["u"], x["combine"], x["w_gate"], x["w_up"], x["w_down"])
    for got, want in zip(dense_reference[2], grads, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("mesh_shape", [None, *MESHES], ids=lambda s: "no-mesh" if s is None else "x".join(map(str, s)))
@pytest.mark.parametrize("name", ["fixed", "pooled", "ragged"])
def test_transport_equals_dense_in_forward_and_gradients_when_nothing_drops(name, mesh_shape, uniform, dense_reference):
    # cf = E: every cell, pool and buffer can hold a shard's every assignment, so nothing can drop.
    moe = MoEConfig(num_experts=E, top_k=K, capacity_factor=float(E), waves=3)
    y, stats, grads = run(name, uniform, moe, mesh_shape)
    y_ref, stats_ref, grads_ref = dense_reference
    np.testing.assert_allclose(y, y_ref, atol=1e-5)
    for key in stats_ref:
        np.testing.assert_array_equal(stats[key], stats_ref[key], err_msg=key)
    for label, got, want in zip(("u", "combine", "w_gate", "w_up", "w_down"), grads, grads_ref, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"d/d{label}")


# --------------------------------------------------------------------------------------------------
# Tight capacity: drop counts against an independent numpy transcription of docs/recipe.md §4's rules.


def shard_blocks(mesh_shape):
    """Token blocks per device in mesh order; the expert all-to-all runs within consecutive S blocks."""
    n, S = math.prod(mesh_shape), mesh_shape[2]
    block = T // n
    return [(b // S, b % S, range(b * block, (b + 1) * block)) for b in range(n)], block, S


def numpy_fixed_keep(x, cf, mesh_shape):
    blocks, block, _ = shard_blocks(mesh_shape)
    cap = max(1, math.ceil(cf * block * K / E))
    keep = np.zeros((T, K), bool)
    for _, _, tokens in blocks:
        used = np.zeros(E, int)
        for t in tokens:
            for k in range(K):
                e = x["expert_idx"][t, k]
                if x["valid"][t]:
                    keep[t, k] = used[e] < cap
                    used[e] += 1
    return keep


def numpy_pooled_keep(x, cf, cf_t, waves, mesh_shape):
    blocks, block, S = shard_blocks(mesh_shape)
    e_loc, A = E // S, block * K
    P = max(1, math.ceil(cf_t * A / (S * waves)))
    R = max(1, math.ceil(cf * A / (e_loc * waves)))
    keep = np.zeros((T, K), bool)
    sender_drops = receiver_drops = 0
    pools = {}  # (group, dest, wave) -> {source: [(pool_rank, t, k)]}
    for group, source, tokens in blocks:
        sent = np.zeros(S, int)
        for t in tokens:
            for k in range(K):
                if not x["valid"][t]:
                    continue
                dest = x["expert_idx"][t, k] // e_loc
                wave, pool_rank = sent[dest] % waves, sent[dest] // waves
                sent[dest] += 1
                if pool_rank >= P:
                    sender_drops += 1
                else:
                    pools.setdefault((group, dest, wave), {}).setdefault(source, []).append((pool_rank, t, k))
    for by_source in pools.values():
        arrived = np.zeros(e_loc, int)
        for source in sorted(by_source):
            for _, t, k in sorted(by_source[source]):
                local = x["expert_idx"][t, k] % e_loc
                if arrived[local] < R:
                    keep[t, k] = True
                else:
                    receiver_drops += 1
                arrived[local] += 1
    return keep, sender_drops, receiver_drops


@pytest.fixture(scope="module")
def skewed():
    return problem(1, skew=0.35)


def assert_dropped_rows_are_exactly_zero(x, y, keep):
    nothing_kept = x["valid"] & ~keep.any(axis=1)
    assert np.all(y[nothing_kept] == 0.0)
    np.testing.assert_allclose(y, numpy_moe(x, keep), atol=2e-5)


def test_fixed_drops_match_numpy_count_and_dropped_assignments_contribute_zero(skewed):
    mesh_shape, cf = (1, 2, 4), 1.0
    y, stats, _ = run("fixed", skewed, MoEConfig(num_experts=E, top_k=K, capacity_factor=cf), mesh_shape)
    keep = numpy_fixed_keep(skewed, cf, mesh_shape)
    expected = K * skewed["valid"].sum() - keep.sum()
    assert expected > 0.1 * K * skewed["valid"].sum()  # the skew really overflows cells
    assert stats["sender_drops"] == expected and stats["receiver_drops"] == 0
    assert_dropped_rows_are_exactly_zero(skewed, y, keep)


def test_pooled_sender_and_receiver_drops_match_numpy_count_and_contribute_zero(skewed):
    mesh_shape, cf, cf_t, waves = (1, 2, 4), 1.0, 1.2, 3
    moe = MoEConfig(num_experts=E, top_k=K, capacity_factor=cf, sender_capacity_factor=cf_t, waves=waves)
    y, stats, _ = run("pooled", skewed, moe, mesh_shape)
    keep, sender, receiver = numpy_pooled_keep(skewed, cf, cf_t, waves, mesh_shape)
    assert sender > 0 and receiver > 0  # both rules are exercised
    assert stats["sender_drops"] == sender and stats["receiver_drops"] == receiver
    assert_dropped_rows_are_exactly_zero(skewed, y, keep)


def test_ragged_reports_zero_drops_and_equals_dense_under_the_same_skew(skewed):
    moe = MoEConfig(num_experts=E, top_k=K, capacity_factor=1.0)
    y, stats, _ = run("ragged", skewed, moe, (1, 2, 4))
    assert stats["sender_drops"] == 0 and stats["receiver_drops"] == 0
    np.testing.assert_allclose(y, numpy_moe(skewed, np.broadcast_to(skewed["valid"][:, None], (T, K))), atol=2e-5)


def numpy_ragged_keep(x, buffer_rows, mesh_shape):
    """A receiver's buffer fills in source order, each source's rows in (expert, token) order."""
    blocks, _, S = shard_blocks(mesh_shape)
    e_loc = E // S
    keep = np.zeros((T, K), bool)
    arrivals = {}  # (group, dest) -> rows in arrival order
    for group, _, tokens in blocks:  # blocks come in source order within a group
        rows = [(x["expert_idx"][t, k], t, k) for t in tokens for k in range(K) if x["valid"][t]]
        for e, t, k in sorted(rows):
            arrivals.setdefault((group, e // e_loc), []).append((t, k))
    for rows in arrivals.values():
        for t, k in rows[:buffer_rows]:
            keep[t, k] = True
    return keep


@pytest.mark.parametrize("exchange", ["grouped", "emulated"])
def test_bounded_ragged_buffer_drops_exactly_the_overflow_rows(skewed, exchange):
    mesh_shape, factor = (1, 2, 4), 1.0
    moe = MoEConfig(num_experts=E, top_k=K, ragged_buffer_factor=factor)
    y, stats, _ = run("ragged", skewed, moe, mesh_shape, transport=ragged_transport(exchange))
    keep = numpy_ragged_keep(skewed, math.ceil(factor * (T // 8) * K), mesh_shape)
    expected = K * skewed["valid"].sum() - keep.sum()
    assert expected > 0
    assert stats["receiver_drops"] == expected and stats["sender_drops"] == 0
    assert_dropped_rows_are_exactly_zero(skewed, y, keep)


# --------------------------------------------------------------------------------------------------
# The CPU's grouped path (sorted tiles, no ragged_dot) against the paths it replaces.


@pytest.mark.parametrize(
    "mesh_shape",
    [None, (1, 2, 4), pytest.param((2, 1, 4), marks=pytest.mark.slow)],
    ids=lambda s: "no-mesh" if s is None else "x".join(map(str, s)),
)
def test_emulated_exchange_of_the_native_body_still_equals_dense(mesh_shape, uniform, dense_reference):
    """The GPU body (offsets, regrouping, drop rule) runs on CPU with the dense-emulated exchange."""
    y, stats, grads = run(
        "ragged", uniform, MoEConfig(num_experts=E, top_k=K), mesh_shape, ragged_transport("emulated")
    )
    np.testing.assert_allclose(y, dense_reference[0], atol=1e-5)
    assert stats["receiver_drops"] == 0
    for got, want in zip(grads, dense_reference[2], strict=True):
        np.testing.assert_allclose(got, want, atol=2e-5)


def lopsided(seed: int):
    """The first half of the tokens routed uniformly, the second half only to experts 0..3 (expert shard 0
    of a 4-way expert axis): on a (2, 1, 4) mesh one expert group takes the smallest exchange branch and
    the other the worst case, where every slice for shard 0 is as full as it can be."""
    x = problem(seed)
    half = T // 2
    x["expert_idx"][half:] = np.stack([np.random.default_rng(seed + t).permutation(4) for t in range(half)])
    return x


@pytest.mark.parametrize("mesh_shape", [(2, 1, 4)], ids=lambda s: "x".join(map(str, s)))
def test_grouped_ragged_equals_dense_in_every_exchange_branch(mesh_shape):
    x = lopsided(3)
    moe = MoEConfig(num_experts=E, top_k=K)
    blocks, block, S = shard_blocks(mesh_shape)
    fullest = {}  # expert group -> its largest slice, which picks the group's static chunk size
    for group, _, tokens in blocks:
        e = x["expert_idx"][list(tokens)][x["valid"][list(tokens)]]
        fullest[group] = max(fullest.get(group, 0), *np.bincount(e.ravel() // (E // S), minlength=S))
    sizes = _chunk_sizes(block * K / S, block * min(K, E // S))
    branches = {g: int(np.sum(np.asarray(sizes[:-1]) < f)) for g, f in fullest.items()}
    assert branches[0] == 0 and branches[1] == len(sizes) - 1  # smallest and largest chunk, one step
    y_ref, stats_ref, grads_ref = run("dense", x, moe)
    y, stats, grads = run("ragged", x, moe, mesh_shape, ragged_transport("grouped"))
    np.testing.assert_allclose(y, y_ref, atol=1e-5)
    np.testing.assert_array_equal(stats["expert_load"], stats_ref["expert_load"])
    assert stats["receiver_drops"] == 0 and stats["sender_drops"] == 0
    for label, got, want in zip(("u", "combine", "w_gate", "w_up", "w_down"), grads, grads_ref, strict=True):
        np.testing.assert_allclose(got, want, atol=3e-5, err_msg=f"d/d{label}")


def test_chunk_sizes_start_above_the_expected_slice_and_end_at_the_largest():
    assert _chunk_sizes(256, 1024) == [320, 480, 720, 1024]
    assert _chunk_sizes(32, 128) == [40, 64, 96, 128]
    assert _chunk_sizes(100, 100) == [100]  # nothing below the largest: a single static size


def test_linear_moves_differentiate_as_their_transpose():
    """A row gather through a partial bijection, wrapped by `_linear` with the inverse gather as its
    transpose, has the gradient autodiff gives the plain gather (and no gradient for unplaced rows)."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(10, 3)).astype(np.float32)
    slot = np.array([5, 11, 0, 2, 11, 7, 1, 3, 11, 9], np.int32)  # 11: out of range, not placed
    take = np.full(11, 10, np.int32)
    placed = slot < 11
    take[slot[placed]] = np.flatnonzero(placed)
    probe = rng.normal(size=(11, 3)).astype(np.float32)

    def moved(x):
        return jnp.sum(_linear(lambda v: _take(v, take), lambda g: _take(g, slot), x) * probe)

    got = jax.grad(moved)(x)
    np.testing.assert_array_equal(got, jax.grad(lambda x: jnp.sum(_take(x, take) * probe))(x))
    assert np.all(got[~placed] == 0)


def test_tiled_swiglu_equals_per_row_experts_and_skips_tiles_past_used():
    """Rows laid out in group tiles through `_tiled_swiglu`: each row gets its own expert, empty and
    skipped tiles give zero, and the gradients equal autodiff of a per-row gather of the expert weights."""
    rng = np.random.default_rng(5)
    n_rows, groups, block, width, hidden = 40, 3, 4, 5, 6
    group = rng.integers(0, groups + 1, size=n_rows).astype(np.int32)  # `groups`: a row that is not placed
    group[:3] = 1
    counts = jnp.asarray(np.bincount(group, minlength=groups + 1)[:groups], jnp.int32)
    rank = np.array([np.sum(group[:i] == group[i]) for i in range(n_rows)], np.int32)
    n_tiles = (n_rows + groups * (block - 1)) // block + 2  # two spare tiles: empty, and past `used`
    slot, source = _tile_slots(jnp.asarray(group), jnp.asarray(rank), counts, n_tiles, block)
    tile_group, used = _tile_groups(counts, n_tiles, block)
    assert int(used) == sum(-(-int(c) // block) for c in counts) < n_tiles
    rows = rng.normal(size=(n_rows, width)).astype(np.float32)
    shapes = ((groups, width, hidden), (groups, width, hidden), (groups, hidden, width))
    w = [jnp.asarray(rng.normal(size=shape) / 2, jnp.float32) for shape in shapes]
    probe = rng.normal(size=(n_rows, width)).astype(np.float32)
    placed = group < groups

    def tiled(rows, wg, wu, wd, used=used):
        x = _take(rows, source).reshape(n_tiles, block, width)
        out = _tiled_swiglu(x, tile_group, used, wg, wu, wd).reshape(n_tiles * block, width)
        return _take(out, slot)

    def per_row(rows, wg, wu, wd):
        e = np.minimum(group, groups - 1)
        h = jax.nn.silu(jnp.einsum("nl,nli->ni", rows, wg[e])) * jnp.einsum("nl,nli->ni", rows, wu[e])
        return jnp.where(placed[:, None], jnp.einsum("ni,nil->nl", h, wd[e]), 0)

    def value_and_grads(fn, used_tiles=None):
        args = {} if used_tiles is None else {"used": used_tiles}
        loss = lambda *a: jnp.sum(fn(*a, **args) * probe)  # noqa: E731
        return jax.jit(lambda *a: (fn(*a, **args), jax.grad(loss, argnums=(0, 1, 2, 3))(*a)))(rows, *w)

    (y, grads), (y_ref, want) = value_and_grads(tiled), value_and_grads(per_row)
    np.testing.assert_allclose(y, y_ref, atol=1e-5)
    for got, ref in zip(grads, want, strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-5)
    # A tile past `used` is skipped even when it holds rows: its rows' outputs and gradients are zero.
    last = np.asarray(slot) // block == int(used) - 1
    y_cut, grads_cut = value_and_grads(tiled, used - 1)
    assert last.any() and np.all(np.asarray(y_cut)[last] == 0) and np.all(np.asarray(grads_cut[0])[last] == 0)
    np.testing.assert_allclose(np.asarray(y_cut)[~last], np.asarray(y)[~last], atol=1e-6)


def test_cpu_ragged_program_has_no_ragged_dot():
    """XLA:CPU lowers `ragged_dot` to a product over every group; the CPU path must not use it."""
    x = problem(2)
    moe = MoEConfig(num_experts=E, top_k=K)
    fn = ragged_transport("grouped")

    def loss(u, w_gate):
        return jnp.sum(fn(u, x["expert_idx"], x["combine"], x["valid"], w_gate, x["w_up"], x["w_down"], moe)[0])

    for mesh_shape in (None, (1, 2, 4)):
        with jax.set_mesh(mesh_of(mesh_shape)) if mesh_shape else contextlib.nullcontext():
            text = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x["u"], x["w_gate"]).lower().as_text()
        assert "ragged" not in text


# --------------------------------------------------------------------------------------------------
# The ragged exchange: the CPU emulation has the collective's documented semantics; the GPU path lowers.


def test_emulated_ragged_all_to_all_reproduces_the_documented_example():
    # The example in jax.lax.ragged_all_to_all's docstring, on an axis of size 2.
    operand = np.array([[1, 2, 2], [3, 4, 0]], np.float32)
    input_offsets = np.array([[0, 1], [0, 1]], np.int32)
    send_sizes = np.array([[1, 2], [1, 1]], np.int32)
    output_offsets = np.array([[0, 0], [1, 2]], np.int32)
    recv_sizes = np.array([[1, 1], [2, 1]], np.int32)
    mesh = jax.make_mesh((2,), ("expert",), axis_types=(AxisType.Auto,))
    shard = _Shard("expert", 2, ("expert",))

    def body(op, io, ss, oo, rs):
        out = _ragged_all_to_all_emulated(
            op[0], jnp.zeros(4, jnp.float32), io[0], ss[0], oo[0], rs[0], shard=shard, max_chunk=3
        )
        return out[None]

    spec = PartitionSpec("expert")
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec), compiler_options=FAST_COMPILE)
    result = f(operand, input_offsets, send_sizes, output_offsets, recv_sizes)
    np.testing.assert_array_equal(result, [[1, 3, 0, 0], [2, 2, 4, 0]])


def test_native_ragged_path_lowers_to_ragged_all_to_all_forward_and_backward():
    """XLA:CPU cannot compile ragged_all_to_all, but tracing and lowering the GPU path catches typos."""
    shapes = problem(2)
    moe = MoEConfig(num_experts=E, top_k=K)
    fn = ragged_transport("native")

    def loss(u, w_gate):
        y, _ = fn(
            u, shapes["expert_idx"], shapes["combine"], shapes["valid"], w_gate, shapes["w_up"], shapes["w_down"], moe
        )
        return jnp.sum(y)

    with jax.set_mesh(mesh_of((1, 2, 4))):
        text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(shapes["u"], shapes["w_gate"]).lower().as_text()
    assert text.count("ragged_all_to_all") == 4  # two exchanges forward, their transposes backward


def test_get_transport_names_every_transport_and_rejects_others():
    for name in ("dense", "fixed", "pooled", "ragged"):
        assert callable(get_transport(name))
    with pytest.raises(ValueError, match=r"unknown moe\.transport"):
        get_transport("carrier-pigeon")


def test_tokens_that_do_not_split_over_the_mesh_are_a_user_error(uniform):
    x = {k: v[:100] if v.shape[0] == T else v for k, v in uniform.items()}
    with jax.set_mesh(mesh_of((1, 2, 4))), pytest.raises(UserError, match="do not split over 8 devices"):
        get_transport("fixed")(
            x["u"],
            x["expert_idx"],
            x["combine"],
            x["valid"],
            x["w_gate"],
            x["w_up"],
            x["w_down"],
            MoEConfig(num_experts=E, top_k=K),
        )


def test_hero_buffers_come_from_the_shared_capacity_formula(hero_recipe):
    """docs/recipe.md §4's hero figures (T = 65,536, S = 64): P = 3,141 and R = 33,497; the ragged worst case is
    S·T·min(K, E_loc) rows, which a bounded `ragged_buffer_factor` caps at f·T·K."""
    moe = hero_recipe.moe
    cap = _capacity(moe, 65536, 64)
    assert (cap.pooled_sender, cap.pooled_receiver, cap.waves) == (3141, 33497, 3)
    assert ragged_buffer_rows(moe, 65536, 64) == 64 * 65536 * 6
    bounded = dataclasses.replace(moe, ragged_buffer_factor=1.5)
    assert ragged_buffer_rows(bounded, 65536, 64) == math.ceil(1.5 * 65536 * 8)


def test_a_config_that_disagrees_with_the_expert_weights_is_rejected(uniform):
    x = uniform
    with pytest.raises(ValueError, match="num_experts=8"):
        get_transport("pooled")(
            x["u"],
            x["expert_idx"],
            x["combine"],
            x["valid"],
            x["w_gate"],
            x["w_up"],
            x["w_down"],
            MoEConfig(num_experts=8, top_k=K),
        )
