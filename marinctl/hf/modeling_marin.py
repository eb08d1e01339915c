# Copied verbatim into every `marinctl export --format hf` directory; loaded by transformers with
# trust_remote_code=True. marinctl never imports this file (it needs torch, an optional extra).
"""PyTorch forward pass of the Marin MoE architecture, as exported by marinctl (docs/recipe.md §2).

    h = GatedNorm(RMSNorm(embed[tokens]))
    per layer:  x += AttnOutConv(Attention(GatedNorm(RMSNorm(x))))
                x += MlpOutConv(LatentMoE(m) + Σ_s Shared_s(m)),  m = GatedNorm(RMSNorm(x))
    logits = lm_head(GatedNorm(RMSNorm(x)))

Attention: GQA with different KV head counts on local (sliding-window) and global layers (a layer with
fewer heads reads the first stored ones), non-parametric QK RMSNorm then q × qk_mult, partial RoPE with
split-halves pairs on local layers and none on global ones, a log-length query scale on global layers past
65,536 tokens, XSA (the output's component along the token's own value vector removed) and a head-wise
gate 2·sigmoid(a W_gate). MoE: a sigmoid router in fp32 selects top-k on the logits plus the QB bias
(`mlp.router.bias`, selection only); combine weights are the unbiased sigmoids renormalized to
`routed_scaling_factor`; routed experts run in an RMS-normalized latent; every assignment is computed
(dropless). Padding (attention_mask 0) is its own segment: real tokens never read it.

No KV cache: `generate` re-runs the whole prefix each step (correct, slow; an export is for evaluation and
fine-tuning, not serving).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast


class MarinConfig(PretrainedConfig):
    model_type = "marin"

    def __init__(
        self,
        vocab_size: int = 264,
        hidden_size: int = 256,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        head_dim: int = 64,
        num_key_value_heads: int = 2,
        num_key_value_heads_local: int = 2,
        num_key_value_heads_global: int = 1,
        global_layers: list[int] | None = None,
        sliding_window: int = 64,
        nope_global: bool = True,
        rope_theta: float = 10000.0,
        partial_rotary_factor: float = 0.5,
        rope_pairing: str = "half",
        qk_norm: bool = True,
        qk_norm_eps: float = 1e-6,
        qk_mult: float = 1.3,
        qk_mult_learnable: bool = False,
        log_length_base: int = 65536,
        xsa: bool = True,
        attention_gate: bool = True,
        rms_norm_eps: float = 1e-5,
        embed_norm: bool = True,
        gated_norm: bool = True,
        gated_norm_rank: int = 32,
        conv_kernel: int = 4,
        conv_sites: list[str] | None = None,
        num_experts: int = 16,
        num_experts_per_tok: int = 4,
        moe_intermediate_size: int = 128,
        moe_latent: bool = True,
        moe_latent_size: int = 128,
        moe_latent_norm: bool = True,
        num_shared_experts: int = 2,
        shared_expert_intermediate_size: int = 128,
        routed_scaling_factor: float = 2.5,
        router_bias_on: str = "logits",
        max_position_embeddings: int = 4096,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.head_dim = head_dim
        self.num_key_value_heads = num_key_value_heads
        self.num_key_value_heads_local = num_key_value_heads_local
        self.num_key_value_heads_global = num_key_value_heads_global
        self.global_layers = list(global_layers if global_layers is not None else [num_hidden_layers - 1])
        self.sliding_window = sliding_window
        self.nope_global = nope_global
        self.rope_theta = rope_theta
        self.partial_rotary_factor = partial_rotary_factor
        if rope_pairing != "half":
            raise ValueError(f"rope_pairing {rope_pairing!r}: this implementation pairs split halves only")
        self.rope_pairing = rope_pairing
        self.qk_norm = qk_norm
        self.qk_norm_eps = qk_norm_eps
        self.qk_mult = qk_mult
        self.qk_mult_learnable = qk_mult_learnable
        self.log_length_base = log_length_base
        self.xsa = xsa
        self.attention_gate = attention_gate
        self.rms_norm_eps = rms_norm_eps
        self.embed_norm = embed_norm
        self.gated_norm = gated_norm
        self.gated_norm_rank = gated_norm_rank
        self.conv_kernel = conv_kernel
        self.conv_sites = list(conv_sites if conv_sites is not None else ["keys", "attn_out", "mlp_out"])
        self.num_experts = num_experts
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size
        self.moe_latent = moe_latent
        self.moe_latent_size = moe_latent_size
        self.moe_latent_norm = moe_latent_norm
        self.num_shared_experts = num_shared_experts
        self.shared_expert_intermediate_size = shared_expert_intermediate_size
        self.routed_scaling_factor = routed_scaling_factor
        self.router_bias_on = router_bias_on
        self.max_position_embeddings = max_position_embeddings
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


XSA_EPS = 1e-6
WEIGHT_SUM_EPS = 1e-9


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Weight(nn.Module):
    """A bare parameter under `.weight` (expert stacks, conv taps)."""

    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms(x, self.eps) * self.weight.float()


class GatedNorm(nn.Module):
    """y ⊙ sigmoid(W_up silu(W_down y)), rank r, on an RMSNorm output y."""

    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.down_proj = nn.Linear(dim, rank, bias=False)
        self.up_proj = nn.Linear(rank, dim, bias=False)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return y * torch.sigmoid(self.up_proj(F.silu(self.down_proj(y))).float())


def short_conv(x: torch.Tensor, weight: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv over the sequence, `weight[c, lag]`, never across a segment boundary."""
    out = x * weight[:, 0]
    S = x.shape[1]
    for lag in range(1, weight.shape[1]):
        shifted = F.pad(x, (0, 0, lag, 0))[:, :S]
        seg_shifted = F.pad(segments, (lag, 0), value=-1)[:, :S]
        out = (
            out + torch.where((seg_shifted == segments)[..., None], shifted, torch.zeros_like(shifted)) * weight[:, lag]
        )
    return out


def rope(x: torch.Tensor, positions: torch.Tensor, rotary_dims: int, theta: float) -> torch.Tensor:
    """Split-halves RoPE on the first `rotary_dims` dims of each head: pairs (i, i + R/2)."""
    if rotary_dims == 0:
        return x
    half = rotary_dims // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) * 2.0 / rotary_dims)
    angle = positions.float()[..., None] * inv_freq
    cos, sin = torch.cos(angle)[:, :, None, :], torch.sin(angle)[:, :, None, :]
    x1, x2, rest = x[..., :half].float(), x[..., half:rotary_dims].float(), x[..., rotary_dims:]
    return torch.cat([(x1 * cos - x2 * sin).to(x.dtype), (x2 * cos + x1 * sin).to(x.dtype), rest], dim=-1)


class MarinAttention(nn.Module):
    def __init__(self, config: MarinConfig, is_global: bool):
        super().__init__()
        D, H, Dh, kv = config.hidden_size, config.num_attention_heads, config.head_dim, config.num_key_value_heads
        self.config, self.is_global = config, is_global
        self.q_proj = nn.Linear(D, H * Dh, bias=False)
        self.k_proj = nn.Linear(D, kv * Dh, bias=False)
        self.v_proj = nn.Linear(D, kv * Dh, bias=False)
        self.o_proj = nn.Linear(H * Dh, D, bias=False)
        if config.attention_gate:
            self.gate_proj = nn.Linear(D, H, bias=False)
        if config.qk_mult_learnable:
            self.qk_mult = nn.Parameter(torch.ones(H))
        if "keys" in config.conv_sites:
            self.k_conv = Weight(kv * Dh, config.conv_kernel)
        if "values" in config.conv_sites:
            self.v_conv = Weight(kv * Dh, config.conv_kernel)

    def forward(self, a: torch.Tensor, segments: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.config
        B, S, _ = a.shape
        H, Dh = c.num_attention_heads, c.head_dim
        q, k, v = self.q_proj(a), self.k_proj(a), self.v_proj(a)
        if hasattr(self, "k_conv"):
            k = short_conv(k, self.k_conv.weight, segments)
        if hasattr(self, "v_conv"):
            v = short_conv(v, self.v_conv.weight, segments)
        q, k, v = q.view(B, S, H, Dh), k.view(B, S, -1, Dh), v.view(B, S, -1, Dh)
        if c.qk_norm:
            q, k = rms(q, c.qk_norm_eps).to(a.dtype), rms(k, c.qk_norm_eps).to(a.dtype)
        mult = torch.full((H,), c.qk_mult, dtype=torch.float32, device=a.device)
        if hasattr(self, "qk_mult"):
            mult = mult * self.qk_mult.float()
        q = q.float() * mult[:, None]
        if self.is_global:
            n = torch.clamp(positions.float() + 1.0, min=c.log_length_base)
            q = q * ((1.0 + 0.1 * torch.log(n / c.log_length_base)) ** 2)[:, :, None, None]
        q = q.to(a.dtype)
        if not (self.is_global and c.nope_global):
            rotary = int(Dh * c.partial_rotary_factor)
            q, k = rope(q, positions, rotary, c.rope_theta), rope(k, positions, rotary, c.rope_theta)
        kv_heads = c.num_key_value_heads_global if self.is_global else c.num_key_value_heads_local
        kv_of_head = torch.arange(H, device=a.device) // (H // kv_heads)
        k, v = k[:, :, kv_of_head], v[:, :, kv_of_head]

        i = torch.arange(S, device=a.device)[:, None]
        j = torch.arange(S, device=a.device)[None, :]
        allowed = j <= i
        if not self.is_global:
            allowed = allowed & (i - j < c.sliding_window)
        mask = allowed[None] & (segments[:, :, None] == segments[:, None, :])
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, Dh]
        scores = torch.matmul(qh.float(), kh.float().transpose(-1, -2)) / math.sqrt(Dh)
        scores = scores.masked_fill(~mask[:, None], torch.finfo(torch.float32).min)
        y = torch.matmul(torch.softmax(scores, dim=-1).to(vh.dtype), vh).transpose(1, 2)  # [B, S, H, Dh]
        if c.xsa:
            y32, v32 = y.float(), v.float()
            coef = (y32 * v32).sum(-1, keepdim=True) / ((v32 * v32).sum(-1, keepdim=True) + XSA_EPS)
            y = (y32 - coef * v32).to(a.dtype)
        if c.attention_gate:
            y = (y.float() * (2.0 * torch.sigmoid(self.gate_proj(a).float()))[..., None]).to(a.dtype)
        return self.o_proj(y.reshape(B, S, H * Dh))


class Router(nn.Module):
    """weight [E, D] (fp32 logits); bias [E] is the quantile-balancing bias: it steers selection only."""

    def __init__(self, config: MarinConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.num_experts))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, width, bias=False)
        self.up_proj = nn.Linear(dim, width, bias=False)
        self.down_proj = nn.Linear(width, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    def __init__(self, config: MarinConfig):
        super().__init__()
        E, I, latent = config.num_experts, config.moe_intermediate_size, config.moe_latent_size
        self.gate_proj = Weight(E, I, latent)
        self.up_proj = Weight(E, I, latent)
        self.down_proj = Weight(E, latent, I)


class MarinMoE(nn.Module):
    def __init__(self, config: MarinConfig):
        super().__init__()
        self.config = config
        D, latent = config.hidden_size, config.moe_latent_size
        self.router = Router(config)
        if config.moe_latent:
            self.latent_down_proj = nn.Linear(D, latent, bias=False)
            if config.moe_latent_norm:
                self.latent_norm = RMSNorm(latent, config.rms_norm_eps)
            self.latent_up_proj = nn.Linear(latent, D, bias=False)
        self.experts = Experts(config)
        self.shared_experts = nn.ModuleList(
            SwiGLU(D, config.shared_expert_intermediate_size) for _ in range(config.num_shared_experts)
        )

    def forward(self, m: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        c = self.config
        B, S, D = m.shape
        x = m.reshape(B * S, D)
        logits = x.float() @ self.router.weight.float().T
        scores = torch.sigmoid(logits) if c.router_bias_on == "sigmoid" else logits
        K, E = c.num_experts_per_tok, c.num_experts
        if K < E:
            idx = torch.topk(scores + self.router.bias.float(), K, dim=-1).indices
        else:
            idx = torch.arange(E, device=m.device).expand(B * S, E)
        w = torch.sigmoid(torch.gather(logits, -1, idx))
        combine = w * c.routed_scaling_factor / (w.sum(-1, keepdim=True) + WEIGHT_SUM_EPS)
        gate = torch.zeros(B * S, E, dtype=combine.dtype, device=m.device).scatter_add(-1, idx, combine)
        gate = gate * valid.reshape(B * S, 1).to(gate.dtype)

        u = x
        if c.moe_latent:
            u = self.latent_down_proj(x)
            if c.moe_latent_norm:
                u = self.latent_norm(u).to(x.dtype)
        y = torch.zeros_like(u, dtype=torch.float32)
        ex = self.experts
        for e in range(E):  # dropless: every selected (token, expert) pair is computed
            rows = torch.nonzero(gate[:, e], as_tuple=True)[0]
            if rows.numel() == 0:
                continue
            h = F.silu(u[rows] @ ex.gate_proj.weight[e].T) * (u[rows] @ ex.up_proj.weight[e].T)
            y.index_add_(0, rows, (h @ ex.down_proj.weight[e].T).float() * gate[rows, e, None])
        out = y.to(x.dtype)
        if c.moe_latent:
            out = self.latent_up_proj(out)
        for shared in self.shared_experts:
            out = out + shared(x)
        return out.reshape(B, S, D)


class MarinDecoderLayer(nn.Module):
    def __init__(self, config: MarinConfig, layer: int):
        super().__init__()
        D, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.input_norm = RMSNorm(D, eps)
        if config.gated_norm:
            self.input_gated_norm = GatedNorm(D, config.gated_norm_rank)
        self.self_attn = MarinAttention(config, is_global=layer in config.global_layers)
        if "attn_out" in config.conv_sites:
            self.attn_out_conv = Weight(D, config.conv_kernel)
        self.post_attention_norm = RMSNorm(D, eps)
        if config.gated_norm:
            self.post_attention_gated_norm = GatedNorm(D, config.gated_norm_rank)
        self.mlp = MarinMoE(config)
        if "mlp_out" in config.conv_sites:
            self.mlp_out_conv = Weight(D, config.conv_kernel)

    def forward(self, x: torch.Tensor, segments: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        a = self.input_norm(x)
        if self.config.gated_norm:
            a = self.input_gated_norm(a)
        h = self.self_attn(a.to(dtype), segments, positions)
        if hasattr(self, "attn_out_conv"):
            h = short_conv(h, self.attn_out_conv.weight, segments)
        x = x + h
        m = self.post_attention_norm(x)
        if self.config.gated_norm:
            m = self.post_attention_gated_norm(m)
        y = self.mlp(m.to(dtype), segments != 0)
        if hasattr(self, "mlp_out_conv"):
            y = short_conv(y, self.mlp_out_conv.weight, segments)
        return x + y


class MarinPreTrainedModel(PreTrainedModel):
    config_class = MarinConfig
    base_model_prefix = "model"
    _no_split_modules = ["MarinDecoderLayer"]  # noqa: RUF012 (transformers reads a class-level list)

    def _init_weights(self, module: nn.Module) -> None:
        # Every tensor comes from the export; a fresh model (from_config) gets marinctl's init shape.
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.5 / math.sqrt(self.config.hidden_size), a=-1.5, b=1.5)


class MarinModel(MarinPreTrainedModel):
    def __init__(self, config: MarinConfig):
        super().__init__(config)
        D, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        if config.embed_norm:
            self.embed_norm = RMSNorm(D, eps)
            if config.gated_norm:
                self.embed_gated_norm = GatedNorm(D, config.gated_norm_rank)
        self.layers = nn.ModuleList(MarinDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = RMSNorm(D, eps)
        if config.gated_norm:
            self.final_gated_norm = GatedNorm(D, config.gated_norm_rank)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        segments = torch.ones_like(input_ids) if attention_mask is None else (attention_mask != 0).long()
        B, S = input_ids.shape
        idx = torch.arange(S, device=input_ids.device).expand(B, S)
        starts = torch.cat([torch.ones_like(segments[:, :1], dtype=torch.bool), segments[:, 1:] != segments[:, :-1]], 1)
        positions = idx - torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
        x = self.embed_tokens(input_ids)
        dtype = x.dtype
        if self.config.embed_norm:
            x = self.embed_norm(x)
            if self.config.gated_norm:
                x = self.embed_gated_norm(x)
            x = x.to(dtype)
        for layer in self.layers:
            x = layer(x, segments, positions)
        h = self.final_norm(x)
        if self.config.gated_norm:
            h = self.final_gated_norm(h)
        return h.to(dtype)


class MarinForCausalLM(MarinPreTrainedModel, GenerationMixin):
    def __init__(self, config: MarinConfig):
        super().__init__(config)
        self.model = MarinModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        h = self.model(input_ids, attention_mask)
        logits = self.lm_head(h).float()
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}
