"""The hero model (docs/recipe.md §2) as equinox modules, readable top to bottom in SPEC order:

- `layers.py`      RMSNorm, GatedNorm, the short causal conv (SConv), the precision contract
- `attention.py`   GQA attention: QK norm × qk_mult, partial RoPE / NoPE, window, documents, XSA, gate
- `attention_blocks.py` which scores its XLA path computes (block geometry; the memory planner counts them)
- `moe.py`         the quantile-balanced sigmoid router, LatentMoE and the shared experts
- `transformer.py` Block (scanned over layers), Transformer, `init_model` / `build_model` / `model_params`
- `loss.py`        `lm_loss` (CE + logit z-loss) and `model_loss` (forward + loss on a packed batch)

Submodules import JAX, except `attention_blocks.py`; this package file does not, so `import marinctl.model.loss` is
the entry point.
"""
