"""Counting: parameters, FLOPs (SPEC 7), expert-parallel capacities (SPEC 4) and a memory estimate.

The planner prints these and the trainer reuses them (MFU, the 791-tokens-per-active-parameter rule),
so there is exactly one FLOP convention in the codebase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from marinctl.params import ParamSpec, param_table, partition_spec, shard_size
from marinctl.recipe import Recipe

BYTES_F32 = 4


@dataclass(frozen=True)
class ParamCount:
    total: int  # every parameter leaf
    matmul: int  # hyperball matrices (MuonH + AdamH) + the token embedding: SPEC 1's "535.3B"
    active: int  # SPEC 1's active-parameter formula
    components: dict[str, int] = field(default_factory=dict)


def _component(path: str) -> str:
    if path.startswith("embed"):
        return "embedding"
    if path.startswith("lm_head"):
        return "lm_head"
    if path.startswith("final"):
        return "final norm"
    if ".experts." in path:
        return "routed experts"
    if ".shared." in path:
        return "shared experts"
    if ".moe." in path:
        return "router + latent"
    if ".attention." in path:
        return "attention"
    if "gated_norm" in path or "_norm." in path:
        return "norms + gated norms"
    if "sconv" in path:
        return "sconv"
    return "other"


def count_params(recipe: Recipe) -> ParamCount:
    table = param_table(recipe)
    components: dict[str, int] = {}
    for path, spec in table.items():
        components[_component(path)] = components.get(_component(path), 0) + spec.size
    m, moe = recipe.model, recipe.moe
    D, L, H, Dh = m.hidden, m.num_layers, m.num_heads, m.head_dim
    width = moe.latent_width if moe.latent else D
    latent_proj = 2 * D * width if moe.latent else 0
    # SPEC 1: embeddings, lm_head, norms, gates and SConv excluded; KV counted at the stored heads.
    active = L * (
        2 * D * H * Dh
        + 2 * D * recipe.stored_kv_heads * Dh
        + D * moe.num_experts
        + moe.top_k * 3 * width * moe.expert_width
        + latent_proj
        + moe.shared_experts * 3 * D * moe.shared_width
    )
    return ParamCount(
        total=sum(s.size for s in table.values()),
        matmul=sum(s.size for p, s in table.items() if s.is_matrix or p == "embed.weight"),
        active=active,
        components=components,
    )


@dataclass(frozen=True)
class Flops:
    per_token: float  # forward FLOPs per token, SPEC 7 (full-square attention, lm_head included)
    per_token_causal: float  # MaxText convention: attention score/value FLOPs halved for causality
    lm_head_per_token: float

    def train(self, tokens: float, *, lm_head: bool = True) -> float:
        f = self.per_token if lm_head else self.per_token - self.lm_head_per_token
        return 3.0 * f * tokens


def flops_per_token(recipe: Recipe, seq_len: int | None = None) -> Flops:
    """SPEC 7. Global layers are counted from the recipe's real layer pattern; SPEC 7 writes G = L // 4,
    which equals the pattern whenever (L-1) is itself a 4th layer (the hero, d768..d1536), and
    undercounts by one where the always-global last layer is extra (d2048: 6 global, not 5)."""
    m, a, moe = recipe.model, recipe.attention, recipe.moe
    D, V, H, Dh = m.hidden, m.vocab_size, m.num_heads, m.head_dim
    S = seq_len or recipe.train.seq_len
    width = moe.latent_width if moe.latent else D
    routed = 2 * 3 * width * moe.expert_width * moe.top_k + (2 * 2 * D * width if moe.latent else 0)
    shared = 2 * 3 * D * moe.shared_width * moe.shared_experts
    mlp = routed + shared + 2 * D * moe.num_experts
    dense = 2 * H * Dh * D  # W_o (SPEC 7 writes 2*D*D, the same when H*Dh = D)

    def qkv(kv: int) -> float:
        return 2 * D * (H * Dh + 2 * kv * Dh)

    def attn(span: int) -> float:
        return 4 * span * H * Dh + 3 * span * H

    f = f_causal = 0.0
    for is_global in recipe.layer_is_global():
        span = S if is_global else min(S, a.window)
        kv = a.global_kv_heads if is_global else a.local_kv_heads
        f += mlp + dense + qkv(kv) + attn(span)
        # Causal: the average query sees ~half the full square; a window caps it at the window.
        mean_span = (S + 1) / 2 if is_global or a.window >= S else a.window - a.window * (a.window - 1) / (2 * S)
        f_causal += mlp + dense + qkv(kv) + attn(mean_span)
    lm_head = 2 * D * V
    return Flops(per_token=f + lm_head, per_token_causal=f_causal + lm_head, lm_head_per_token=lm_head)


@dataclass(frozen=True)
class Capacity:
    tokens_per_shard: int  # T
    expert_shards: int  # S
    experts_per_shard: int  # E_loc
    assignments: int  # A = T*K
    fixed_cell: int  # rows per (sender shard, expert) for the fixed all-to-all
    pooled_sender: int  # P, rows per destination per wave
    pooled_receiver: int  # R, rows per local expert per wave
    waves: int
    ragged_receiver: int  # rows of the ragged receive buffer per shard (worst case unless bounded)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def capacity(recipe: Recipe, tokens_per_shard: int, expert_shards: int) -> Capacity:
    """SPEC 4's buffer sizes for T tokens per shard and an expert axis of S shards."""
    moe = recipe.moe
    T, S, E, K, W = tokens_per_shard, expert_shards, moe.num_experts, moe.top_k, moe.waves
    cf = moe.capacity_factor
    cf_t = moe.sender_capacity_factor if moe.sender_capacity_factor is not None else cf
    A = T * K
    E_loc = E // S
    # Ragged worst case: every token of all S senders picks min(K, E_loc) of this shard's experts, so
    # nothing can drop. At hero scale that is ~25M rows per GPU; `moe.ragged_buffer_factor` = f bounds
    # it at ceil(f*T*K) (QB keeps the expected arrival at T*K) and overflow counts as receiver drops.
    ragged = S * T * min(K, E_loc)
    if moe.ragged_buffer_factor is not None:
        ragged = min(ragged, max(1, math.ceil(moe.ragged_buffer_factor * A)))
    return Capacity(
        tokens_per_shard=T,
        expert_shards=S,
        experts_per_shard=E_loc,
        assignments=A,
        fixed_cell=max(1, math.ceil(cf * A / E)),
        pooled_sender=max(1, math.ceil(cf_t * A / (S * W))),
        pooled_receiver=max(1, math.ceil(cf * A / (E_loc * W))),
        waves=W,
        ragged_receiver=ragged,
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device. Parameters and optimizer state are exact for the sharding rules; activations
    are an estimate (saved residuals under the remat policy plus one block's working set)."""

    params: int
    optimizer: int
    gradients: int
    activations: int
    moe_buffers: int

    @property
    def total(self) -> int:
        return self.params + self.optimizer + self.gradients + self.activations + self.moe_buffers


def optimizer_state_elems(spec: ParamSpec) -> int:
    """fp32 optimizer slots per element: Muon keeps momentum; Adam and AdamH keep m and v."""
    return 1 if spec.group == "muonh" else 2


def memory_estimate(recipe: Recipe, mesh: dict[str, int]) -> MemoryEstimate:
    table = param_table(recipe)
    n_dev = math.prod(mesh.values())
    params = sum(shard_size(s, mesh) for s in table.values()) * BYTES_F32
    opt = sum(shard_size(s, mesh) * optimizer_state_elems(s) for s in table.values()) * BYTES_F32
    m, moe = recipe.model, recipe.moe
    tokens = recipe.tokens_per_step // (n_dev * recipe.train.grad_accum)
    act_bytes = 2 if m.compute_dtype == "bfloat16" else BYTES_F32
    if m.compute_dtype == "auto":
        act_bytes = 2  # what a GPU run uses; the CPU demo runs f32 and is far from its limits
    D, L = m.hidden, m.num_layers
    width = moe.latent_width if moe.latent else D
    saved = L * tokens * D * act_bytes * (1 if m.remat == "full" else 12)
    # One block live during backward: q/k/v/o, attention probabilities for one head at a time, the
    # routed rows (K per token) at latent and expert width, the shared experts and the logits.
    S = recipe.train.seq_len
    block = (
        tokens
        * act_bytes
        * (8 * D + moe.top_k * (2 * width + 3 * moe.expert_width) + 3 * moe.shared_experts * moe.shared_width)
        + (tokens // S) * S * S * act_bytes
    )
    logits = tokens * m.vocab_size * BYTES_F32 * 2
    cap = capacity(recipe, tokens, mesh.get("expert", 1))
    if moe.transport == "fixed":
        rows = moe.num_experts * cap.fixed_cell
    elif moe.transport == "pooled":
        sender = cap.expert_shards * cap.pooled_sender * cap.waves
        rows = sender + cap.experts_per_shard * cap.pooled_receiver * cap.waves
    elif moe.transport == "ragged":
        rows = cap.assignments + cap.ragged_receiver
    else:
        rows = cap.assignments
    moe_buffers = 2 * rows * width * act_bytes
    return MemoryEstimate(
        params=params, optimizer=opt, gradients=params, activations=saved + block + logits, moe_buffers=moe_buffers
    )


def partition_summary(recipe: Recipe, mesh: dict[str, int]) -> dict[str, tuple]:
    """path -> mesh axes per dim, for `plan --verbose` and the dry run."""
    return {p: partition_spec(s, mesh) for p, s in param_table(recipe).items()}
