"""Expert-parallel transports (docs/recipe.md §4): one routing result, interchangeable ways to compute it.

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
- `ragged`: dropless; `jax.lax.ragged_all_to_all` + `jax.lax.ragged_dot` on GPU/TPU. On CPU, whose
  XLA has neither a ragged collective nor a grouped `ragged_dot` (it lowers to a product over every
  group), sorted rows in per-expert tiles through a tile loop that costs the rows it computes, with no
  exchange on one expert shard (`_grouped_body`); identical results.
The last three run per shard inside `jax.shard_map` over the context mesh (`jax.set_mesh`): tokens are
sharded over every mesh axis, expert weights' E dim over `expert`, and rows cross the `expert` axis at
latent width. Without a mesh they run the same algorithm as one shard. Routing metrics derived from the
stats (entropy, max/mean load, drop fraction) are in `marinctl.routing.quantile_balance`.
"""

# ruff: noqa: F722 (jaxtyping shape strings are not Python expressions)

from __future__ import annotations

import functools
import math
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

    def vary(self, x):
        """Mark expert weights (replicated over the token axes but `expert`) as varying there, so their
        gradient's psum over those axes happens here: not inside a per-device branch (devices that skip
        it would leave the collective waiting) nor inside a custom VJP."""
        axes = tuple(a for a in self.token_axes if a != self.expert_axis)
        return jax.lax.pcast(x, axes, to="varying") if axes else x


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
    earlier tokens win every capacity contest (docs/recipe.md §4)."""
    order = jnp.argsort(keys, stable=True)
    counts = jnp.bincount(keys, length=n_groups)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(keys.shape[0], dtype=jnp.int32) - starts[keys[order]].astype(jnp.int32)
    return jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)


def _local_experts(x: Float[Array, "E_loc N l"], w_gate, w_up, w_down) -> Float[Array, "E_loc N l"]:
    """SwiGLU of each local expert over its rows (docs/recipe.md §2.10 step 5). No biases, so an empty (zero) buffer
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
# fixed: fixed-capacity all-to-all (docs/recipe.md §4)


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
# pooled: pooled waves (docs/recipe.md §4), the hero's transport before the switch to ragged


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
# ragged: dropless (docs/recipe.md §4), the hero's transport after the switch


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


# --------------------------------------------------------------------------------------------------
# grouped: the CPU's dropless path. XLA:CPU has no ragged collective, and `jax.lax.ragged_dot` lowers
# there to a dense product over every group (each row costs G rows), so on CPU the rows are laid out in
# tiles of `block` rows, each tile holding one expert's rows, and a loop runs the tiles that hold rows:
# every computed row is an assigned row or the padding of its expert's last tile.


def _take(x, index, fill: int = 0):
    """x[index] along the first axis; an out-of-range index reads `fill` (a zero row for data)."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=fill)


def _linear(move: Callable, transpose: Callable, x, *aux):
    """`move(x)` for a linear `move` (row gathers through partial bijections, all_to_all, a static-branch
    switch of those) whose transpose is given. Differentiated as a linear map, autodiff keeps no residuals
    (a switch would hand every branch's zero-filled residuals to the backward pass), and the gradient of a
    gather is the inverse gather, not the scatter-add that XLA:CPU runs as a serial loop.
    `aux` (integer arrays: indices, the branch) passes explicitly, as a custom VJP may not close over them."""

    @jax.custom_vjp
    def f(x, *aux):
        return move(x, *aux)

    f.defvjp(lambda x, *aux: (move(x, *aux), aux), lambda aux, g: (transpose(g, *aux), *(None for _ in aux)))
    return f(x, *aux)


def _inverse(slot: Int[Array, " N"], size: int) -> Int[Array, " size"]:
    """inverse[slot[j]] = j for every slot in [0, size); `len(slot)` (out of range) elsewhere."""
    n = slot.shape[0]
    return jnp.full((size,), n, jnp.int32).at[slot].set(jnp.arange(n, dtype=jnp.int32), mode="drop")


def _block_rows(rows_per_group: float) -> int:
    """Tile height: a power of two near half a group's expected rows, within [8, 128]. Taller tiles run
    faster matmuls and fewer loop steps but pad each group's last tile by up to `block - 1` rows."""
    target = max(8.0, min(128.0, rows_per_group / 2))
    return 1 << math.floor(math.log2(target))


def _tile_groups(counts: Int[Array, " G"], n_tiles: int, block: int) -> tuple[Int[Array, " n"], Int[Array, ""]]:
    """Group g owns tiles `start[g] .. start[g] + ceil(counts[g] / block)`: each tile's group (sorted)
    and how many tiles hold rows (the rest are empty)."""
    ends = jnp.cumsum((counts + block - 1) // block)
    tile_group = jnp.sum(jnp.arange(n_tiles, dtype=jnp.int32)[:, None] >= ends[None, :], axis=1)
    return jnp.minimum(tile_group, counts.shape[0] - 1).astype(jnp.int32), ends[-1]


def _tile_slots(group: Int[Array, " N"], rank: Int[Array, " N"], counts: Int[Array, " G"], n_tiles: int, block: int):
    """(slot, source): row r goes to buffer row `slot[r]` (its group's tiles, in `rank` order; rows with
    group = G are not placed and get `n_tiles·block`), and `source` is the inverse."""
    n_groups = counts.shape[0]
    tiles = (counts + block - 1) // block
    starts = jnp.cumsum(tiles) - tiles
    placed = group < n_groups
    slot = jnp.where(placed, starts[jnp.minimum(group, n_groups - 1)] * block + rank, n_tiles * block)
    slot = slot.astype(jnp.int32)
    return slot, _inverse(slot, n_tiles * block)


def _chunk_sizes(expected: float, largest: int) -> list[int]:
    """Static slice sizes for the exchange: 1.25× the expected slice, growing 1.5× up to the largest
    possible one. The wire carries at most 1.5× the rows of the fullest slice and the branches stay few."""
    sizes, size = [], 8 * math.ceil(1.25 * expected / 8)
    while size < largest:
        sizes.append(size)
        size = 8 * math.ceil(1.5 * size / 8)
    return [*sizes, largest]


def _max_tiles(rows: int, n_groups: int, block: int) -> int:
    """Tiles that any split of `rows` rows over `n_groups` groups can need: Σ ceil(c_g / block)."""
    return max(1, (rows + n_groups * (block - 1)) // block)


@jax.custom_vjp
def _tiled_swiglu(x: Float[Array, "n b l"], tile_group: Int[Array, " n"], used: Int[Array, ""], w_gate, w_up, w_down):
    """SwiGLU of each tile's expert over its rows (docs/recipe.md §2.10 step 5); tiles from `used` on are skipped.

    A loop over tiles that reads its expert's matrices in place: a batched matmul would first copy every
    tile's [l, I] matrices (more bytes than the rows), and autodiff of the loop would add a whole [E, l, I]
    cotangent per tile. The custom backward is the same loop, adding each tile's weight gradient into
    its expert's slot only. Empty rows are zero and stay zero (no biases); skipped tiles come out zero.
    """
    return _tiled_swiglu_fwd(x, tile_group, used, w_gate, w_up, w_down)[0]


def _tile_loop(body, used, xs, init=None):
    """`body(carry, xs[n]) -> (carry, out_n)` for tiles n < `used` only (a loop with a data-dependent trip
    count, so tiles past `used` cost nothing); outputs of the other tiles are zero. Like `lax.scan`'s
    result, but not differentiable: the callers are the two halves of a custom VJP."""
    n_tiles = jax.tree.leaves(xs)[0].shape[0]
    first = jax.tree.map(lambda a: a[0], xs)
    out_shape = jax.eval_shape(lambda c, x: body(c, x)[1], init, first)
    # A zero that varies like the tile rows (over every mesh axis inside `shard_map`): the loop's carry
    # must keep one type, and fresh zeros vary over none.
    zero = jnp.zeros((), jax.tree.leaves(xs)[0].dtype) * jax.tree.leaves(xs)[0].reshape(-1)[0]
    outs = jax.tree.map(lambda o: jnp.zeros((n_tiles, *o.shape), o.dtype) + zero.astype(o.dtype), out_shape)
    init = jax.tree.map(lambda c: c + zero.astype(c.dtype), init)

    def step(n, state):
        carry, outs = state
        carry, out = body(carry, jax.tree.map(lambda a: a[n], xs))
        return carry, jax.tree.map(lambda buf, o: buf.at[n].set(o), outs, out)

    return jax.lax.fori_loop(0, used, step, (init, outs))


def _tiled_swiglu_fwd(x, tile_group, used, w_gate, w_up, w_down):
    w_gate, w_up, w_down = (jnp.asarray(w) for w in (w_gate, w_up, w_down))

    def body(_, args):
        rows, e = args
        gate, up = rows @ w_gate[e], rows @ w_up[e]
        return None, ((jax.nn.silu(gate) * up) @ w_down[e], gate, up)

    _, (out, gate, up) = _tile_loop(body, used, (x, tile_group))
    return out, (x, tile_group, used, gate, up, w_gate, w_up, w_down)


def _tiled_swiglu_bwd(res, d_out):
    x, tile_group, used, gate, up, w_gate, w_up, w_down = res

    def body(grads, args):
        dg_w, du_w, dd_w = grads
        rows, e, a, b, dy = args
        sig = jax.nn.sigmoid(a)
        silu = a * sig
        dd_w = dd_w.at[e].add((silu * b).T @ dy)
        dh = dy @ w_down[e].T
        da = dh * b * sig * (1 + a * (1 - sig))  # d silu(a)/da = σ(a)(1 + a(1 − σ(a)))
        db = dh * silu
        dg_w = dg_w.at[e].add(rows.T @ da)
        du_w = du_w.at[e].add(rows.T @ db)
        return (dg_w, du_w, dd_w), da @ w_gate[e].T + db @ w_up[e].T

    zeros = tuple(jnp.zeros_like(w) for w in (w_gate, w_up, w_down))
    (dg_w, du_w, dd_w), dx = _tile_loop(body, used, (x, tile_group, gate, up, d_out), zeros)
    return dx, None, None, dg_w, du_w, dd_w


_tiled_swiglu.defvjp(_tiled_swiglu_fwd, _tiled_swiglu_bwd)


def _grouped_body(u, expert_idx, combine, valid, w_gate, w_up, w_down, *, moe: MoEConfig, shard: _Shard):
    """`ragged`'s layout and drop rule (see `_ragged_body`) without ragged collectives or `ragged_dot`.

    Sender: assignments sorted by expert; the slice for expert shard d goes out padded to a static chunk
    in one dense all_to_all (none with one expert shard, where sender and receiver moves compose into
    one gather). Receiver: from the all-gathered counts it knows each arriving row's local expert and
    places it in that expert's tiles (source order, then the sender's order, as the ragged buffer fills),
    runs the used tiles (`_tiled_swiglu`) and sends the rows back the same way. Every move is a gather
    whose gradient is a gather (`_linear`). The chunk comes from a few static sizes chosen by the
    fullest slice in the expert group, so neither the wire nor the tile loop is sized by the worst case
    (every token of every sender to one shard) unless the batch is that skewed.
    """
    n_tokens, width = u.shape
    e_loc, S = w_gate.shape[0], shard.expert_size
    n_experts, top_k = e_loc * S, expert_idx.shape[1]
    expert, _, valid_a = _flat_assignments(expert_idx, valid)
    n_assign = expert.shape[0]
    sort_key = jnp.where(valid_a, expert, n_experts)
    order = jnp.argsort(sort_key, stable=True)
    counts = jnp.bincount(sort_key, length=n_experts + 1)[:n_experts].astype(jnp.int32)
    gathered = shard.all_gather(counts)  # [source, expert]
    me = shard.index()
    buffer_rows = ragged_buffer_rows(moe, n_tokens, S)
    flow = gathered.reshape(S, S, e_loc).sum(axis=2)  # flow[s, d]: rows source s has for shard d
    landing = _exclusive_cumsum(flow, axis=0)
    sent = jnp.clip(buffer_rows - landing, 0, flow)  # what fits in d's buffer (all of it when unbounded)

    # Sender: sorted row i is position i - (start of its slice) in the slice for its destination.
    sorted_key = sort_key[order]
    dest = jnp.minimum(sorted_key // e_loc, S - 1)
    position = jnp.arange(n_assign, dtype=jnp.int32) - _exclusive_cumsum(flow[me])[dest]
    goes = (sorted_key < n_experts) & (position < sent[me][dest])
    keep = jnp.zeros_like(valid_a).at[order].set(goes)
    # Receiver: source s's chunk holds sent[s, me] rows, its counts for my experts in expert order, cut at the tail.
    mine = jax.lax.dynamic_slice_in_dim(gathered, me * e_loc, e_loc, axis=1)  # [source, local expert]
    mine = jnp.clip(sent[:, me][:, None] - _exclusive_cumsum(mine, axis=1), 0, mine)
    block = _block_rows(n_assign / e_loc)
    u_rep = jnp.repeat(u, top_k, axis=0)  # assignment a = t·K + k reads u[t]
    weights = tuple(shard.vary(w) for w in (w_gate, w_up, w_down))
    # A slice carries at most one row per (token, expert) pair, and never more than the buffer. The wire
    # and the tile buffer are sized for the fullest slice in the expert group, from a few static sizes
    # (every member sees the same counts, so all take the same branch and meet in the same collectives).
    chunks = _chunk_sizes(n_assign / S, min(n_tokens * min(top_k, e_loc), buffer_rows)) if S > 1 else [n_assign]
    branch = jnp.sum(jnp.asarray(chunks[:-1], jnp.int32) < jnp.max(sent)).astype(jnp.int32)
    n_max = _max_tiles(min(S * chunks[-1], buffer_rows), e_loc, block)
    tile_group, used = _tile_groups(mine.sum(axis=0), n_max, block)

    def layout(chunk: int, plan):
        """Where my sorted rows sit on the wire (`chunk_slot`) and arriving rows in my tiles."""
        order, goes, dest, position, mine = plan
        chunk_slot_sorted = jnp.where(goes, dest * chunk + position, S * chunk).astype(jnp.int32)
        chunk_slot = jnp.zeros((n_assign,), jnp.int32).at[order].set(chunk_slot_sorted)
        row = jnp.arange(chunk, dtype=jnp.int32)
        local = jnp.sum(row[None, :, None] >= jnp.cumsum(mine, axis=1)[:, None, :], axis=2)  # e_loc: empty row
        local_c = jnp.minimum(local, e_loc - 1)
        within = row[None, :] - jnp.take_along_axis(_exclusive_cumsum(mine, axis=1), local_c, axis=1)
        rank = within + jnp.take_along_axis(_exclusive_cumsum(mine, axis=0), local_c, axis=1)
        n_tiles = _max_tiles(min(S * chunk, buffer_rows), e_loc, block)
        slot, source = _tile_slots(local.reshape(-1), rank.reshape(-1), mine.sum(axis=0), n_tiles, block)
        return chunk_slot, slot, source, n_tiles * block

    def to_tiles(chunk: int, x: Float[Array, "A l"], plan) -> Float[Array, "M l"]:
        """Assignment rows -> my tile buffer (zero rows up to the largest branch's size)."""
        chunk_slot, _, source, rows = layout(chunk, plan)
        if S == 1:  # no exchange: sender and receiver moves compose into one gather
            x = _take(x, _take(_inverse(chunk_slot, chunk), source, fill=n_assign))
        else:
            send = _take(x, _inverse(chunk_slot, S * chunk)).reshape(S, chunk, width)
            x = _take(shard.all_to_all(send).reshape(S * chunk, width), source)
        return jnp.pad(x, ((0, n_max * block - rows), (0, 0)))

    def from_tiles(chunk: int, y: Float[Array, "M l"], plan) -> Float[Array, "A l"]:
        """The transpose of `to_tiles`: tile rows back to the assignments they came from (0 if dropped)."""
        chunk_slot, slot, _, rows = layout(chunk, plan)
        y = y[:rows]
        if S == 1:
            return _take(y, _take(slot, chunk_slot, fill=rows))
        back = _take(y, slot).reshape(S, chunk, width)
        return _take(shard.all_to_all(back).reshape(S * chunk, width), chunk_slot)

    def pick(fns):
        def run(x, branch, *plan):
            return fns[0](x, plan) if len(fns) == 1 else jax.lax.switch(branch, fns, x, plan)

        return run

    forward = pick([functools.partial(to_tiles, c) for c in chunks])
    backward = pick([functools.partial(from_tiles, c) for c in chunks])
    plan = (branch, order, goes, dest, position, mine)
    x = _linear(forward, backward, u_rep, *plan)
    out = _tiled_swiglu(x.reshape(n_max, block, width), tile_group, used, *weights)
    y_assign = _linear(backward, forward, out.reshape(n_max * block, width), *plan)
    y = _combine(y_assign, combine, keep)
    receiver_drops = jnp.sum(valid_a) - jnp.sum(keep)
    return y, _stats(shard, expert, valid_a, n_experts, 0, receiver_drops)


EXCHANGES = ("native", "emulated", "grouped")


def ragged_transport(exchange: str | None = None) -> Transport:
    """The dropless transport (unless `moe.ragged_buffer_factor` bounds its buffer), one of three ways:

    - "native": `jax.lax.ragged_all_to_all` + `jax.lax.ragged_dot` (GPU/TPU; lowered in CPU tests);
    - "emulated": the same body with the exchange emulated by a dense all_to_all: the CPU check of the
      native path's offsets (slow: CPU `ragged_dot` costs every group for every row);
    - "grouped": the CPU's: sorted rows in per-expert tiles, a loop over the tiles that hold rows, no
      exchange with one expert shard (`_grouped_body`).
    `None` picks by backend: "native" on GPU/TPU, "grouped" elsewhere. All give identical results.
    """
    if exchange is not None and exchange not in EXCHANGES:
        raise ValueError(f"unknown ragged exchange {exchange!r} (choose from {', '.join(EXCHANGES)})")

    def ragged(u, expert_idx, combine, valid, w_gate, w_up, w_down, *, moe: MoEConfig, shard: _Shard):
        how = exchange or ("native" if jax.default_backend() in ("gpu", "cuda", "rocm", "tpu") else "grouped")
        if how == "grouped":
            return _grouped_body(u, expert_idx, combine, valid, w_gate, w_up, w_down, moe=moe, shard=shard)
        return _ragged_body(
            u, expert_idx, combine, valid, w_gate, w_up, w_down, moe=moe, shard=shard, native=how == "native"
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
