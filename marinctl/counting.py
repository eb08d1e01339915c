"""Counting: parameters, FLOPs (recipe §7), expert-parallel capacities (recipe §4) and a memory estimate.

The planner prints these and the trainer reuses them (MFU, the 791-tokens-per-active-parameter rule),
so there is exactly one FLOP convention in the codebase.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from marinctl.model.attention_blocks import global_scores, local_scores
from marinctl.params import ParamSpec, ns_shard_size, param_table, partition_spec, shard_size
from marinctl.recipe import Recipe

BYTES_F32 = 4


@dataclass(frozen=True)
class ParamCount:
    total: int  # every parameter leaf
    matmul: int  # hyperball matrices (MuonH + AdamH) + the token embedding: docs/recipe.md §1's "535.3B"
    active: int  # docs/recipe.md §1's active-parameter formula
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
    # docs/recipe.md §1: embeddings, lm_head, norms, gates and SConv excluded; KV counted at the stored heads.
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
    per_token: float  # forward FLOPs per token, docs/recipe.md §7 (full-square attention, lm_head included)
    per_token_causal: float  # MaxText convention: attention score/value FLOPs halved for causality
    lm_head_per_token: float

    def train(self, tokens: float, *, lm_head: bool = True) -> float:
        f = self.per_token if lm_head else self.per_token - self.lm_head_per_token
        return 3.0 * f * tokens


def flops_per_token(recipe: Recipe, seq_len: int | None = None) -> Flops:
    """recipe §7. Global layers are counted from the recipe's real layer pattern; recipe §7 writes G = L // 4,
    which equals the pattern whenever (L-1) is itself a 4th layer (the hero, d768..d1536), and
    undercounts by one where the always-global last layer is extra (d2048: 6 global, not 5)."""
    m, a, moe = recipe.model, recipe.attention, recipe.moe
    D, V, H, Dh = m.hidden, m.vocab_size, m.num_heads, m.head_dim
    S = seq_len or recipe.train.seq_len
    width = moe.latent_width if moe.latent else D
    routed = 2 * 3 * width * moe.expert_width * moe.top_k + (2 * 2 * D * width if moe.latent else 0)
    shared = 2 * 3 * D * moe.shared_width * moe.shared_experts
    mlp = routed + shared + 2 * D * moe.num_experts
    dense = 2 * H * Dh * D  # W_o (docs/recipe.md §7 writes 2*D*D, the same when H*Dh = D)

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
    """docs/recipe.md §4's buffer sizes for T tokens per shard and an expert axis of S shards."""
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


Platform = Literal["gpu", "cpu"]

# Components of the per-device peak, in the order the dry run prints them. The first three are exact
# (shapes x shardings); the rest are the planner's model of what is alive at the step's peak.
STATE_PARTS = ("params", "optimizer", "gradients")
ACTIVATION_PARTS = (
    "remat saves",  # residuals kept across the forward for the backward (the scan's stacked carry)
    "attention",  # one block's attention half, recomputed in the backward: projections, scores, output
    "norms + sconv",  # RMSNorm/GatedNorm outputs (fp32) and the SConv/residual sums of one block
    "router",  # router logits, margins and the QB histogram input, fp32 [T, E]
    "moe transport",  # routed rows at latent width: sender pools, receive buffers, outputs, combine
    "experts",  # expert hidden activations [rows, I]: gate, up, silu, product and its gradient
    "shared experts",  # the shared SwiGLU experts' hidden activations [T, n, I_sh]
    "fsdp gathers",  # one layer's non-expert weights gathered (compute dtype) and their full-size grads
    "logits / CE",  # fp32 logits and their gradient, one CE chunk at a time (model.ce_chunk_tokens)
    "optimizer update",  # Newton-Schulz working copies of the largest matrix stack (the optimizer phase)
    "gradient accumulator",  # train.grad_accum > 1: the running sum beside each micro-batch's grads
)
# Per-device bytes the step keeps in the host's (pinned) memory instead: not in the device peak.
HOST_PARTS = ("remat saves",)  # model.remat = "offload": every layer's block input, forward to backward


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device at the train step's peak, by component (`parts`, in `STATE_PARTS` +
    `ACTIVATION_PARTS` order; components of phases that are not the peak read 0).

    The step has three candidate peaks: the backward through one block (saved residuals + that block's
    recomputed activations), the loss (saved residuals + one CE chunk) and the optimizer update (saved
    residuals gone, Newton-Schulz temporaries). Parameters, optimizer state and gradients are alive in
    all three. `phases` holds each phase's activation bytes; `peak_phase` names the largest. `host`
    (`HOST_PARTS` order) is what the step keeps in the host's pinned memory through the backward, beside
    the device peak rather than in it (`total`).
    """

    parts: dict[str, int]
    host: dict[str, int]
    phases: dict[str, int]
    peak_phase: str
    platform: str
    compute_bytes: int
    attention_impl: str

    @property
    def params(self) -> int:
        return self.parts["params"]

    @property
    def optimizer(self) -> int:
        return self.parts["optimizer"]

    @property
    def gradients(self) -> int:
        return self.parts["gradients"] + self.parts["gradient accumulator"]

    @property
    def moe_buffers(self) -> int:
        return self.parts["moe transport"] + self.parts["experts"]

    @property
    def activations(self) -> int:
        """Everything at the peak except state, gradients and the MoE buffers."""
        return self.total - self.params - self.optimizer - self.gradients - self.moe_buffers

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "params": self.params,
            "optimizer": self.optimizer,
            "gradients": self.gradients,
            "activations": self.activations,
            "moe_buffers": self.moe_buffers,
            "total": self.total,
            "parts": dict(self.parts),
            "phases": dict(self.phases),
            "peak_phase": self.peak_phase,
            "host": dict(self.host),
            "host_total": sum(self.host.values()),
            "platform": self.platform,
            "compute_bytes": self.compute_bytes,
            "attention_impl": self.attention_impl,
        }


def optimizer_state_elems(spec: ParamSpec) -> int:
    """fp32 optimizer slots per element: Muon keeps momentum; Adam and AdamH keep m and v."""
    return 1 if spec.group == "muonh" else 2


def compute_bytes(recipe: Recipe, platform: Platform = "gpu") -> int:
    """Bytes per activation element: `model.compute_dtype`, where "auto" is bf16 on a GPU, fp32 on CPU."""
    dtype = recipe.model.compute_dtype
    if dtype == "auto":
        return 2 if platform == "gpu" else BYTES_F32
    return 2 if dtype == "bfloat16" else BYTES_F32


def transport_rows(recipe: Recipe, cap: Capacity) -> tuple[int, int]:
    """(rows at latent width that one block's transport keeps alive, rows that go through an expert).

    Counted from the transports' buffers (marinctl/routing/transports.py): the gathered inputs and the
    gathered outputs (A rows each), the sender side and the receiver side of each exchange, both ways.
    """
    moe = recipe.moe
    A = cap.assignments
    if moe.transport == "fixed":
        sent = moe.num_experts * cap.fixed_cell  # [S, E_loc, cap] each way
        expert_rows = sent
        return 2 * A + 4 * sent, expert_rows
    if moe.transport == "pooled":
        sent = cap.expert_shards * cap.pooled_sender * cap.waves
        expert_rows = cap.experts_per_shard * cap.pooled_receiver * cap.waves
        # send pool, its arrival, the receive buffer, the expert output, its gather back to arrival
        # order, the arrival back at the sender: 4 pool-sized and 2 buffer-sized per wave.
        return 2 * A + 4 * sent + 2 * expert_rows, expert_rows
    if moe.transport == "ragged":
        expert_rows = cap.ragged_receiver
        return 2 * A + 2 * A + 2 * expert_rows, expert_rows
    # dense: every token through every expert, no buffers but [T, E, I] hidden activations
    return 2 * A, cap.tokens_per_shard * moe.num_experts


def memory_estimate(recipe: Recipe, mesh: dict[str, int], platform: Platform = "gpu") -> MemoryEstimate:
    """The per-device peak of one train step on `mesh` (sizes per axis) on a `platform` device.

    `platform` decides what "auto" means: bf16 activations and cuDNN flash attention on a GPU (the
    hero's target), fp32 and the masked-softmax XLA path on CPU (what compiles here, and what the
    `--compile` cross-check and tests/train/test_memory_plan.py compare against XLA's own analysis).
    """
    table = param_table(recipe)
    n_dev = math.prod(mesh.values())
    m, a, moe, t = recipe.model, recipe.attention, recipe.moe, recipe.train
    f4 = BYTES_F32
    act = compute_bytes(recipe, platform)
    impl = a.impl
    if impl == "auto":
        impl = "cudnn" if platform == "gpu" and act == 2 else "xla"

    params = sum(shard_size(s, mesh) for s in table.values()) * f4
    opt = sum(shard_size(s, mesh) * optimizer_state_elems(s) for s in table.values()) * f4
    grads = params  # fp32 like the master weights: the cast's cotangent comes back in fp32
    accum = params if t.grad_accum > 1 else 0

    D, L, V, H, Dh = m.hidden, m.num_layers, m.vocab_size, m.num_heads, m.head_dim
    S = t.seq_len
    rows = t.batch_size // (n_dev * t.grad_accum)  # sequences per device per micro-batch
    T = rows * S  # tokens per device per micro-batch
    kv = recipe.stored_kv_heads
    width = moe.latent_width if moe.latent else D
    r = m.gated_norm_rank if m.gated_norm else 0
    n_sh, I_sh = moe.shared_experts, moe.shared_width

    # --- one block's activations (per device), the set its backward reads --------------------------
    normalize = D * (f4 + act) + (r * act + D * f4 if m.gated_norm else 0)  # x̂ fp32, gate, cast
    sconv = sum(D if s in ("attn_out", "mlp_out") else kv * Dh for s in m.sconv_sites)
    norms_b = T * (2 * normalize + (sconv + 2 * D) * act)  # two pre-norms; SConv outputs; residual sums
    # q/k/v projections, normed+scaled q and k, RoPE'd q/k, grouped copies, output, XSA, gate, W_o.
    proj = (H + 2 * kv) * Dh * act + (H + kv) * Dh * (f4 + act) + 2 * H * Dh * act + H * Dh * act
    xsa = 2 * H * Dh * f4 if a.xsa else 0
    gate = H * f4 + H * Dh * act if a.gate else 0
    attn_b = T * (proj + xsa + gate + D * act)
    if impl == "xla":
        # Per score element: fp32 scores and their softmax, the probabilities in the compute dtype and
        # the mask. Global layers compute the block-causal part of the square, local layers the band of key
        # blocks: exactly the scores marinctl/model/attention.py computes (the geometry is shared,
        # marinctl/model/attention_blocks.py). Under remat the layer kind is a `lax.cond`, whose outputs carry
        # both branches' residuals, so both shapes stay allocated through the block's backward (the
        # compiled steps' peaks show them).
        per_score = 2 * f4 + act + 1
        kinds = recipe.layer_is_global()
        kind_scores = {g: rows * H * (global_scores(S) if g else local_scores(S, a.window)) * per_score for g in kinds}
        layer_scores = [kind_scores[g] for g in kinds]
        # Without remat each layer runs its own kind (no `lax.cond`): the block at the peak holds the larger.
        attn_scores = max(layer_scores) if m.remat == "none" else sum(kind_scores.values())
    else:  # flash attention keeps the log-sum-exp per query and head; the rest is tiled on chip
        layer_scores = [T * H * f4] * L
        attn_scores = T * H * f4
    attn_b += attn_scores
    cap = capacity(recipe, T, mesh.get("expert", 1))
    latent_rows, expert_rows = transport_rows(recipe, cap)
    router_b = T * moe.num_experts * f4 * 3  # logits, margins, sigmoid scores
    latent_b = T * (2 * width * act + width * f4) if moe.latent else 0  # u, its norm, the latent out
    transport_b = latent_rows * width * act + latent_b
    # gate and up projections, silu(gate) and its product with up, and the product's gradient while the
    # expert backward runs: five [rows, I] buffers at the measured peaks.
    experts_b = expert_rows * moe.expert_width * act * 5
    shared_b = T * n_sh * I_sh * act * 3 + T * D * act if n_sh else 0
    # FSDP: one layer's non-expert weights gathered in the compute dtype, and their fp32 gradients at
    # full size before the reduce-scatter.
    layer_dense = sum(s.size // L for p, s in table.items() if p.startswith("blocks.") and "experts" not in s.axes)
    fsdp_b = layer_dense * (act + f4) if n_dev > 1 else 0
    mlp_b = router_b + transport_b + experts_b + shared_b
    # Both halves of the block count: in the compiled steps measured (tests/train/test_memory_plan.py
    # and the hero's CPU compile) the peak falls in the MLP half's backward, with the attention half's
    # recomputed residuals already allocated beside it.
    block = norms_b + attn_b + mlp_b + fsdp_b

    # --- what the forward keeps for the backward, per remat policy ----------------------------------
    offloaded = 0  # bytes of those kept in the host's pinned memory instead of the device's
    if m.remat == "offload" and platform != "cpu":
        # Full remat with each block input copied to pinned host memory in the forward and back to the
        # device one layer at a time in the backward: on the device, the layer being recomputed and the
        # next one's input on its way in.
        offloaded = L * T * D * act
        saved = min(2, L) * T * D * act
    elif m.remat in ("full", "offload"):
        # Each block's input: the scan carry. XLA:CPU stores a bf16 carry's stack as fp32 (seen in the
        # hero's compiled CPU step); a GPU keeps it in bf16. XLA:CPU lowers "offload"'s host placement
        # as a no-op (its device memory is the host's), so on CPU "offload" compiles to "full".
        saved = L * T * D * (f4 if platform == "cpu" else act)
    elif m.remat == "save_dots":  # matmul outputs; the elementwise rest is recomputed
        dots = (H + 2 * kv) * Dh + 2 * D + width * 2 + n_sh * I_sh * 2
        saved = L * (T * dots * act + latent_rows * width * act + expert_rows * moe.expert_width * act * 2)
    else:  # every layer's own working set, its attention scores by its kind
        saved = L * (norms_b + attn_b - attn_scores + mlp_b) + sum(layer_scores)

    # --- the loss: fp32 logits and their gradient for one chunk, the final hidden states ------------
    # `model.ce_chunk_tokens` per device: chunks of whole positions over this device's rows
    # (marinctl/model/loss.py `chunk_length`); 0, or a chunk as long as the sequence, is unchunked.
    chunk_pos = S if m.ce_chunk_tokens <= 0 else max(1, min(S, m.ce_chunk_tokens // rows))
    ce_tokens = rows * chunk_pos
    lm_head_full = D * V * (act + f4) if n_dev > 1 else 0  # gathered lm_head, its full-size gradient
    ce_b = ce_tokens * V * f4 * 3 + T * D * (act + f4) * 2 + lm_head_full  # logits, their gradient, softmax
    # Unchunked, the logits and their gradient can outlive the loss: nothing needs the lm_head's weight
    # gradient before the optimizer, so XLA may take it after the blocks' backward (a measured CPU step
    # did), and both [T, V] fp32 buffers sit beside every block's backward. Chunked, each chunk's
    # gradient is folded into the lm_head's inside the chunk loop.
    held_logits = 2 * T * V * f4 if chunk_pos >= S else 0

    # --- the optimizer: Newton-Schulz iterates the largest matrix stack in fp32 ------------------
    # Under a mesh each device iterates whole matrices, its share of the stack (marinctl/optim/muon.py).
    biggest = max((ns_shard_size(s, mesh) for s in table.values() if s.group == "muonh"), default=0)
    ns_b = biggest * f4 * 4  # X, the Gram matrix, its square and the next iterate

    phases = {"backward": saved + block + held_logits, "loss": saved + ce_b, "optimizer": ns_b}
    peak = max(phases, key=phases.__getitem__)
    zero = dict.fromkeys(ACTIVATION_PARTS, 0)
    parts = {"params": params, "optimizer": opt, "gradients": grads, **zero, "gradient accumulator": accum}
    if peak == "backward":
        parts |= {
            "remat saves": saved,
            "attention": attn_b,
            "norms + sconv": norms_b,
            "router": router_b,
            "moe transport": transport_b,
            "experts": experts_b,
            "shared experts": shared_b,
            "fsdp gathers": fsdp_b,
            "logits / CE": held_logits,
        }
    elif peak == "loss":
        parts |= {"remat saves": saved, "logits / CE": ce_b}
    else:
        parts |= {"optimizer update": ns_b}
    return MemoryEstimate(
        parts=parts,
        host={"remat saves": offloaded},
        phases=phases,
        peak_phase=peak,
        platform=platform,
        compute_bytes=act,
        attention_impl=impl,
    )


def partition_summary(recipe: Recipe, mesh: dict[str, int]) -> dict[str, tuple]:
    """path -> mesh axes per dim, for `plan --verbose` and the dry run."""
    return {p: partition_spec(s, mesh) for p, s in param_table(recipe).items()}
