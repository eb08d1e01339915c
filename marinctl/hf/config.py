"""config.json and generation_config.json of a Hugging Face–style export.

Field names follow the transformers conventions where one exists (`hidden_size`, `num_attention_heads`,
`rope_theta`, `partial_rotary_factor`, `num_experts_per_tok`, `routed_scaling_factor`, ...); the rest
name marinctl's own architecture (docs/recipe.md §2): per-layer KV head counts, NoPE global layers, the
QK multiplier, XSA, GatedNorm, SConv, the latent MoE. `modeling_marin.py` reads exactly these fields.
"""

from __future__ import annotations

from typing import Any

from marinctl import __version__
from marinctl.recipe import Recipe

MODEL_TYPE = "marin"
ARCHITECTURE = "MarinForCausalLM"
MODELING_FILE = "modeling_marin.py"
FORMAT, FORMAT_VERSION = "marinctl-hf", 1
LOG_LENGTH_BASE = 65536  # marinctl.model.attention.LOG_LENGTH_BASE (kept import-free of jax)


def architecture_fields(recipe: Recipe) -> dict[str, Any]:
    """Everything the forward pass depends on, as config.json fields."""
    m, a, moe = recipe.model, recipe.attention, recipe.moe
    return {
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "head_dim": m.head_dim,
        "num_key_value_heads": recipe.stored_kv_heads,
        "num_key_value_heads_local": a.local_kv_heads,
        "num_key_value_heads_global": a.global_kv_heads,
        "global_layers": [i for i, g in enumerate(recipe.layer_is_global()) if g],
        "sliding_window": a.window,
        "nope_global": a.nope_global,
        "rope_theta": a.rope_theta,
        "partial_rotary_factor": a.rope_fraction,
        "rope_pairing": "half",  # pairs (i, i + R/2), the GPT-NeoX / Llama-HF layout
        "qk_norm": a.qk_norm,
        "qk_norm_eps": a.qk_norm_eps,
        "qk_mult": a.qk_mult,
        "qk_mult_learnable": a.qk_mult_learnable,
        "log_length_base": LOG_LENGTH_BASE,
        "xsa": a.xsa,
        "attention_gate": a.gate,
        "rms_norm_eps": m.norm_eps,
        "embed_norm": m.embed_norm,
        "gated_norm": m.gated_norm,
        "gated_norm_rank": m.gated_norm_rank,
        "conv_kernel": m.sconv_kernel,
        "conv_sites": list(m.sconv_sites),
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": moe.expert_width,
        "moe_latent": moe.latent,
        "moe_latent_size": moe.latent_width if moe.latent else m.hidden,
        "moe_latent_norm": moe.latent and moe.latent_norm,
        "num_shared_experts": moe.shared_experts,
        "shared_expert_intermediate_size": moe.shared_width,
        "routed_scaling_factor": moe.router_weight_sum,
        "router_bias_on": "logits" if moe.qb_variant == "logit" else "sigmoid",
    }


def hf_config(recipe: Recipe, step: int, dtype: str, special: dict[str, int | None]) -> dict[str, Any]:
    """config.json: transformers' bookkeeping, the architecture fields, and where the weights came from."""
    return {
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        "auto_map": {
            "AutoConfig": f"{MODELING_FILE[:-3]}.MarinConfig",
            "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.{ARCHITECTURE}",
        },
        "torch_dtype": dtype,
        "tie_word_embeddings": False,
        "max_position_embeddings": recipe.train.seq_len,
        **{f"{k}_token_id": v for k, v in special.items()},
        **architecture_fields(recipe),
        "marinctl": {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "marinctl_version": __version__,
            "recipe": recipe.name,
            "step": step,
        },
    }


def generation_config(recipe: Recipe, special: dict[str, int | None]) -> dict[str, Any]:
    """Greedy decoding up to the trained context, stopping at <eos>."""
    return {
        **{f"{k}_token_id": v for k, v in special.items()},
        "do_sample": False,
        "max_length": recipe.train.seq_len,
    }
