"""Expert-parallel transports (SPEC 4): one routing result, interchangeable ways to compute it.

Every transport has the same signature (the "grug" template: plain functions chosen by `moe.transport`):

    fn(u [T,l], expert_idx [T,K], combine [T,K], valid [T], w_gate [E,l,I], w_up [E,l,I], w_down [E,I,l], moe)
        -> (y [T,l], stats)

with `y[t] = Σ_k combine[t,k] · SwiGLU_{expert_idx[t,k]}(u[t])` over the assignments the transport kept
(dropped ones contribute exactly 0; padding tokens contribute 0 and are not counted), and
`stats = {expert_load [E], assignments, sender_drops, receiver_drops}` as global sums (expert_load is
counted before drops). Arrays are global-view: the model calls these under jit.

- `dense`: the dropless reference, every token through every expert; no mesh needed.
- `fixed`: fixed-capacity cells per (sender, expert), one all_to_all each way (token dropping).
- `pooled`: pooled waves, sender pools per destination and receiver buffers per expert (the hero's
  transport before the switch); sender and receiver drops are counted separately.
- `ragged`: dropless; `jax.lax.ragged_all_to_all` + `jax.lax.ragged_dot` on GPU/TPU, an emulated
  exchange with identical results on CPU.
The last three run per shard inside `jax.shard_map` over the context mesh (`jax.set_mesh`): tokens are
sharded over every mesh axis, expert weights' E dim over `expert`, and rows cross the `expert` axis at
latent width. Without a mesh they run the same algorithm as one shard. Routing metrics derived from the
stats (entropy, max/mean load, drop fraction) are in `marinctl.routing.quantile_balance`.
"""

# ruff: noqa: F722 (jaxtyping shape strings are not Python expressions)

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from marinctl.counting import Capacity, capacity
from marinctl.errors import UserError
from marinctl.recipe import MoEConfig, Recipe

Stats = dict[str, Array]
Transport = Callable[..., tuple[Float[Array, "T l"], Stats]]


def _assignment_stats(expert_idx: Int[Array, "T K"], valid: Bool[Array, " T"], n_experts: int) -> Stats:
    """Load per expert before any drop, and the number of valid assignments."""
    weight = jnp.broadcast_to(valid[:, None], expert_idx.shape).astype(jnp.float32)
    load = jax.ops.segment_sum(weight.reshape(-1), expert_idx.reshape(-1), num_segments=n_experts)
    return {"expert_load": load, "assignments": jnp.sum(weight)}


def dense(
    u: Float[Array, "T l"],
    expert_idx: Int[Array, "T K"],
    combine: Float[Array, "T K"],
    valid: Bool[Array, " T"],
    w_gate: Float[Array, "E l I"],
    w_up: Float[Array, "E l I"],
    w_down: Float[Array, "E I l"],
    moe: MoEConfig,
) -> tuple[Float[Array, "T l"], Stats]:
    """Dropless reference: every token through every expert, then keep the selected ones.

    E/K times the routed FLOPs of a real transport, but nothing to get wrong: no sorting, no buffers,
    no collectives, and XLA shards it like any einsum. Used for tests and dropless evaluation.
    """
    n_experts = w_gate.shape[0]
    # gate[t,e] = Σ_k combine[t,k]·[expert_idx[t,k] = e], zero for padding tokens.
    one_hot = jax.nn.one_hot(expert_idx, n_experts, dtype=combine.dtype)
    gate = jnp.einsum("tk,tke->te", combine, one_hot) * valid[:, None].astype(combine.dtype)
    hidden = jax.nn.silu(jnp.einsum("tl,eli->tei", u, w_gate)) * jnp.einsum("tl,eli->tei", u, w_up)
    y = jnp.einsum("tei,eil->tl", hidden * gate[:, :, None].astype(hidden.dtype), w_down).astype(u.dtype)
    zero = jnp.zeros((), jnp.float32)
    return y, {**_assignment_stats(expert_idx, valid, n_experts), "sender_drops": zero, "receiver_drops": zero}


# --------------------------------------------------------------------------------------------------
# Expert-parallel plumbing: every transport below runs per shard inside `jax.shard_map`.


@dataclass(frozen=True)
class _Shard:
    """The collectives one shard uses. Tokens are sharded over every mesh axis; the all-to-alls run over
    `expert` only (among the devices of one (replica, data) group); stats are summed over every axis.
    With no mesh the same code runs as a single shard and the collectives are identities."""

    expert_axis: str | None
    expert_size: int
    token_axes: tuple[str, ...]

    def psum(self, x):
        return jax.lax.psum(x, self.token_axes) if self.token_axes else x

    def all_to_all(self, x):
        """x[d] goes to expert shard d; result[s] came from expert shard s."""
        return jax.lax.all_to_all(x, self.expert_axis, 0, 0) if self.expert_axis else x

    def all_gather(self, x):
        return jax.lax.all_gather(x, self.expert_axis) if self.expert_axis else x[None]

    def index(self):
        return jax.lax.axis_index(self.expert_axis) if self.expert_axis else jnp.int32(0)


Body = Callable[..., tuple[Float[Array, "T l"], Stats]]


def _expert_parallel(body: Body) -> Transport:
    """Wrap a per-shard body in `shard_map` over the context mesh (or run it as one shard without one)."""

    @functools.wraps(body)
    def transport(u, expert_idx, combine, valid, w_gate, w_up, w_down, moe: MoEConfig):
        if moe.num_experts != w_gate.shape[0]:  # capacities are sized from the config
            raise ValueError(f"moe.num_experts={moe.num_experts} but the expert weights hold {w_gate.shape[0]}")
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:  # no mesh: one shard, no collectives (a 1-device mesh still runs the real ones)
            return body(u, expert_idx, combine, valid, w_gate, w_up, w_down, moe=moe, shard=_Shard(None, 1, ()))
        axes = tuple(mesh.axis_names)
        expert_axis = "expert" if "expert" in axes else None
        expert_size = mesh.shape["expert"] if expert_axis else 1
        n_tokens, n_experts = u.shape[0], w_gate.shape[0]
        if n_tokens % mesh.size:
            raise UserError(f"moe: {n_tokens} tokens per step do not split over {mesh.size} devices")
        if n_experts % expert_size:
            raise UserError(f"moe.num_experts={n_experts} does not split over parallel.expert={expert_size}")
        tokens, experts = P(axes), P(expert_axis)
        per_shard = jax.shard_map(
            functools.partial(body, moe=moe, shard=_Shard(expert_axis, expert_size, axes)),
            mesh=mesh,
            in_specs=(tokens, tokens, tokens, tokens, experts, experts, experts),
            out_specs=(tokens, P()),
        )
        return per_shard(u, expert_idx, combine, valid, w_gate, w_up, w_down)

    return transport


def _rank_within_group(keys: Int[Array, " N"], n_groups: int) -> Int[Array, " N"]:
    """How many earlier elements share each element's key (keys in [0, n_groups)): a stable sort, so
    earlier tokens win every capacity contest (SPEC 4)."""
    order = jnp.argsort(keys, stable=True)
    counts = jnp.bincount(keys, length=n_groups)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(keys.shape[0], dtype=jnp.int32) - starts[keys[order]].astype(jnp.int32)
    return jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)


def _local_experts(x: Float[Array, "E_loc N l"], w_gate, w_up, w_down) -> Float[Array, "E_loc N l"]:
    """SwiGLU of each local expert over its rows (SPEC 2 LatentMoE 5). No biases, so an empty (zero) buffer
    row comes out zero and needs no mask before the matmul."""
    hidden = jax.nn.silu(jnp.einsum("enl,eli->eni", x, w_gate)) * jnp.einsum("enl,eli->eni", x, w_up)
    return jnp.einsum("eni,eil->enl", hidden, w_down)


def _flat_assignments(expert_idx: Int[Array, "T K"], valid: Bool[Array, " T"]):
    """Assignments in token-major order a = t·K + k: (expert, token, is valid)."""
    n_tokens, top_k = expert_idx.shape
    expert = expert_idx.reshape(-1).astype(jnp.int32)
    token = jnp.repeat(jnp.arange(n_tokens, dtype=jnp.int32), top_k)
    return expert, token, jnp.repeat(valid, top_k)


def _combine(y_assign: Float[Array, "A l"], combine: Float[Array, "T K"], keep: Bool[Array, " A"]):
    """y[t] = Σ_k combine[t,k]·y_a over kept assignments; `where`, not a multiply, so a dropped row is
    exactly zero (and its gradient too) whatever its buffer slot held."""
    n_tokens, top_k = combine.shape
    y_assign = jnp.where(keep[:, None], y_assign, 0).reshape(n_tokens, top_k, -1)
    return jnp.einsum("tk,tkl->tl", combine.astype(y_assign.dtype), y_assign)


def _stats(shard: _Shard, expert, valid_a, n_experts: int, sender_drops, receiver_drops) -> Stats:
    load = jax.ops.segment_sum(valid_a.astype(jnp.float32), expert, num_segments=n_experts)
    return {
        "expert_load": shard.psum(load),
        "assignments": shard.psum(jnp.sum(valid_a.astype(jnp.float32))),
        "sender_drops": shard.psum(jnp.asarray(sender_drops, jnp.float32)),
        "receiver_drops": shard.psum(jnp.asarray(receiver_drops, jnp.float32)),
    }


def _capacity(moe: MoEConfig, tokens_per_shard: int, expert_shards: int) -> Capacity:
    """Buffer sizes from the one formula in the codebase (`marinctl.counting.capacity`)."""
    return capacity(Recipe(moe=moe), tokens_per_shard, expert_shards)


# --------------------------------------------------------------------------------------------------
# fixed: fixed-capacity all-to-all (SPEC 4)


@_expert_parallel
def fixed(u, expert_idx, combine, valid, w_gate, w_up, w_down, *, moe: MoEConfig, shard: _Shard):
    """Token dropping with one cell of `cap = max(1, ceil(cf·A/E))` rows per (sender shard, expert).

    Assignments are ranked within their expert in token order (slot); `slot < cap` travels. The send
    buffer is [S, E_loc, cap, l] (destination shard major), one all_to_all there and one back.
    """
    n_tokens, width = u.shape
    e_loc, S = w_gate.shape[0], shard.expert_size
    n_experts = e_loc * S
    cap = _capacity(moe, n_tokens, S).fixed_cell
    expert, token, valid_a = _flat_assignments(expert_idx, valid)
    # Padding assignments queue behind a sentinel expert so they never take a slot.
    slot = _rank_within_group(jnp.where(valid_a, expert, n_experts), n_experts + 1)
    keep = valid_a & (slot < cap)
    cell = jnp.where(keep, expert * cap + slot, n_experts * cap)  # out of range: not sent
    send = jnp.zeros((n_experts * cap, width), u.dtype).at[cell].add(u[token], mode="drop")
    recv = shard.all_to_all(send.reshape(S, e_loc, cap, width))  # [source, local expert, slot, l]
    rows = recv.transpose(1, 0, 2, 3).reshape(e_loc, S * cap, width)
    out = _local_experts(rows, w_gate, w_up, w_down).reshape(e_loc, S, cap, width).transpose(1, 0, 2, 3)
    back = shard.all_to_all(out).reshape(n_experts * cap, width)
    y = _combine(back[jnp.minimum(cell, n_experts * cap - 1)], combine, keep)
    drops = jnp.sum(valid_a) - jnp.sum(keep)
    return y, _stats(shard, expert, valid_a, n_experts, drops, 0)


# --------------------------------------------------------------------------------------------------
# pooled: pooled waves (SPEC 4), the hero's transport before the switch to ragged


@_expert_parallel
def pooled(u, expert_idx, combine, valid, w_gate, w_up, w_down, *, moe: MoEConfig, shard: _Shard):
    """W waves; per wave a sender pool of P rows per destination shard and a receiver buffer of R rows
    per local expert. Pools are shared by a destination's experts, so a skewed expert borrows its
    neighbours' room on the wire; the receiver then caps each expert at R.

    dest_rank = rank among this sender's valid assignments to the same destination (token order);
    wave = dest_rank mod W, pool_rank = dest_rank div W; sender drop iff pool_rank >= P. On the receiver
    rows arrive in (source shard, pool slot) order; receiver drop iff the rank among the wave's arrivals
    for the same local expert is >= R. Waves are separate collectives so XLA can overlap wave w+1's
    exchange with wave w's experts.
    """
    n_tokens, width = u.shape
    e_loc, S, W = w_gate.shape[0], shard.expert_size, moe.waves
    n_experts = e_loc * S
    cap = _capacity(moe, n_tokens, S)
    P_, R_ = cap.pooled_sender, cap.pooled_receiver
    expert, token, valid_a = _flat_assignments(expert_idx, valid)
    dest = expert // e_loc
    dest_rank = _rank_within_group(jnp.where(valid_a, dest, S), S + 1)
    wave, pool_rank = dest_rank % W, dest_rank // W
    keep = valid_a & (pool_rank < P_)
    slot = jnp.where(keep, (wave * S + dest) * P_ + pool_rank, W * S * P_)  # [wave, dest, pool slot]
    send = jnp.zeros((W * S * P_, width), u.dtype).at[slot].add(u[token], mode="drop")
    send_expert = jnp.full((W * S * P_,), e_loc, jnp.int32).at[slot].set(expert % e_loc, mode="drop")
    send, send_expert = send.reshape(W, S, P_, width), send_expert.reshape(W, S, P_)

    back, receiver_drops = [], jnp.int32(0)
    for w in range(W):
        rows = shard.all_to_all(send[w]).reshape(S * P_, width)  # arrival order: (source, pool slot)
        local = shard.all_to_all(send_expert[w]).reshape(S * P_)  # e_loc marks an empty row
        arrival = _rank_within_group(local, e_loc + 1)
        arrived = local < e_loc
        accept = arrived & (arrival < R_)
        receiver_drops += jnp.sum(arrived & ~accept)
        cell = jnp.where(accept, local * R_ + arrival, e_loc * R_)
        buffer = jnp.zeros((e_loc * R_, width), u.dtype).at[cell].add(rows, mode="drop")
        out = _local_experts(buffer.reshape(e_loc, R_, width), w_gate, w_up, w_down).reshape(e_loc * R_, width)
        out = jnp.where(accept[:, None], out[jnp.minimum(cell, e_loc * R_ - 1)], 0)  # receiver drops -> 0
        back.append(shard.all_to_all(out.reshape(S, P_, width)))
    back = jnp.stack(back).reshape(W * S * P_, width)
    y = _combine(back[jnp.minimum(slot, W * S * P_ - 1)], combine, keep)
    sender_drops = jnp.sum(valid_a) - jnp.sum(keep)
    return y, _stats(shard, expert, valid_a, n_experts, sender_drops, receiver_drops)


# --------------------------------------------------------------------------------------------------
# ragged: dropless (SPEC 4), the hero's transport after the switch


def _ragged_all_to_all_emulated(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, shard: _Shard, max_chunk: int
):
    """`jax.lax.ragged_all_to_all` semantics from a dense all_to_all (XLA:CPU has no ragged one).

    Each slice is padded to `max_chunk` rows (a bound on any slice), exchanged, and written at the
    offset its sender chose, exactly as the real collective writes it; `output` elsewhere is kept.
    """
    rows = jnp.arange(max_chunk, dtype=jnp.int32)
    take = input_offsets[:, None] + rows[None, :]
    sent = (rows[None, :] < send_sizes[:, None]).reshape(*take.shape, *(1,) * (operand.ndim - 1))
    chunks = jnp.where(sent, operand[jnp.minimum(take, operand.shape[0] - 1)], 0)
    received = shard.all_to_all(chunks)  # [source, max_chunk, ...]
    at = shard.all_to_all(output_offsets[:, None])[:, 0]  # where each source asked its slice to go
    put = jnp.where(rows[None, :] < recv_sizes[:, None], at[:, None] + rows[None, :], output.shape[0])
    return output.at[put.reshape(-1)].set(received.reshape(-1, *operand.shape[1:]), mode="drop")


def _ragged_exchange(native: bool, shard: _Shard, max_chunk: int):
    if native and shard.expert_axis:
        return functools.partial(jax.lax.ragged_all_to_all, axis_name=shard.expert_axis)
    return functools.partial(_ragged_all_to_all_emulated, shard=shard, max_chunk=max_chunk)


def _exclusive_cumsum(x, axis: int = 0):
    return jnp.cumsum(x, axis=axis) - x


def ragged_buffer_rows(moe: MoEConfig, tokens_per_shard: int, expert_shards: int) -> int:
    """Rows of the ragged transport's receive buffer per shard (`counting.capacity`'s formula)."""
    return _capacity(moe, tokens_per_shard, expert_shards).ragged_receiver


def _ragged_body(u, expert_idx, combine, valid, w_gate, w_up, w_down, *, moe: MoEConfig, shard: _Shard, native: bool):
    """Sort by expert, all-gather counts [S, E], exchange exactly the rows each expert needs, grouped
    matmuls (`ragged_dot`), exchange back. Every offset comes from the gathered counts, so both
    directions and the receiver's regrouping agree without further communication.

    A receiver's buffer fills in source order, each source's slice in expert order; with a bounded
    buffer the rows past its end are not sent (the sender knows the layout from the counts) and count
    as receiver drops. With the default worst-case buffer that never happens.
    """
    n_tokens, width = u.shape
    e_loc, S = w_gate.shape[0], shard.expert_size
    n_experts, top_k = e_loc * S, expert_idx.shape[1]
    expert, token, valid_a = _flat_assignments(expert_idx, valid)
    n_assign = expert.shape[0]
    sort_key = jnp.where(valid_a, expert, n_experts)  # padding sorts last and is never sent
    order = jnp.argsort(sort_key, stable=True)
    rows = u[token[order]]
    counts = jnp.bincount(sort_key, length=n_experts + 1)[:n_experts]
    gathered = shard.all_gather(counts.astype(jnp.int32))  # [source, expert]
    me = shard.index()
    buffer_rows = ragged_buffer_rows(moe, n_tokens, S)
    flow = gathered.reshape(S, S, e_loc).sum(axis=2)  # flow[s, d]: rows source s has for shard d
    landing = _exclusive_cumsum(flow, axis=0)  # where s's slice starts in d's buffer (after sources < s)
    sent = jnp.clip(buffer_rows - landing, 0, flow)  # what fits in d's buffer
    landing = jnp.minimum(landing, buffer_rows)
    input_offsets = _exclusive_cumsum(flow[me])  # my slice for d, in my expert-sorted rows
    send_sizes, recv_sizes = sent[me], sent[:, me]
    output_offsets, recv_offsets = landing[me], landing[:, me]
    source_offsets = _exclusive_cumsum(flow, axis=1)[:, me]  # where source s keeps its slice for me
    # A slice carries at most one row per (token, expert) pair, and never more than the buffer.
    max_chunk = min(n_tokens * min(top_k, e_loc), buffer_rows)
    exchange = _ragged_exchange(native, shard, max_chunk)
    received = exchange(
        rows, jnp.zeros((buffer_rows, width), u.dtype), input_offsets, send_sizes, output_offsets, recv_sizes
    )
    # The buffer holds (source, local expert) groups in that order; regroup by local expert for ragged_dot.
    mine = jax.lax.dynamic_slice_in_dim(gathered, me * e_loc, e_loc, axis=1)  # [source, local expert]
    mine = jnp.clip(recv_sizes[:, None] - _exclusive_cumsum(mine, axis=1), 0, mine)  # a cut slice loses its tail
    group_ends = jnp.cumsum(mine.reshape(-1))
    group = jnp.searchsorted(group_ends, jnp.arange(buffer_rows, dtype=jnp.int32), side="right")
    local = jnp.where(group < S * e_loc, group % e_loc, e_loc)  # e_loc: unused tail of the buffer
    by_expert = jnp.argsort(local, stable=True)
    group_sizes = mine.sum(axis=0)
    x = received[by_expert]
    hidden = jax.nn.silu(jax.lax.ragged_dot(x, w_gate, group_sizes)) * jax.lax.ragged_dot(x, w_up, group_sizes)
    out = jnp.zeros_like(received).at[by_expert].set(jax.lax.ragged_dot(hidden, w_down, group_sizes))
    back = exchange(out, jnp.zeros((n_assign, width), u.dtype), recv_offsets, recv_sizes, source_offsets, send_sizes)
    # Which of my sorted rows went out: position within its destination's slice < what fit there.
    dest = jnp.minimum(sort_key[order] // e_loc, S - 1)
    fits = jnp.arange(n_assign) - input_offsets[dest] < send_sizes[dest]
    keep = jnp.zeros_like(valid_a).at[order].set(valid_a[order] & fits)
    y = _combine(jnp.zeros_like(back).at[order].set(back), combine, keep)
    receiver_drops = jnp.sum(flow[me] - send_sizes)
    return y, _stats(shard, expert, valid_a, n_experts, 0, receiver_drops)


def ragged_transport(native: bool | None = None) -> Transport:
    """The dropless transport (unless `moe.ragged_buffer_factor` bounds its buffer). `native=None` picks
    by backend: `jax.lax.ragged_all_to_all` on GPU/TPU, the emulated exchange (identical results) on
    CPU, whose XLA rejects the ragged collective. The bench forces either to compare them."""

    def ragged(u, expert_idx, combine, valid, w_gate, w_up, w_down, *, moe: MoEConfig, shard: _Shard):
        use_native = jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") if native is None else native
        return _ragged_body(
            u, expert_idx, combine, valid, w_gate, w_up, w_down, moe=moe, shard=shard, native=use_native
        )

    return _expert_parallel(ragged)


ragged = ragged_transport()

TRANSPORTS: dict[str, Transport] = {"dense": dense, "fixed": fixed, "pooled": pooled, "ragged": ragged}


def get_transport(name: str) -> Transport:
    """The transport function for `moe.transport`."""
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown moe.transport {name!r} (choose from {', '.join(TRANSPORTS)})") from None
