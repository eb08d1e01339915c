"""Hugging Face–style export and import: config.json, per-layer `[out, in]` safetensors, tokenizer files and
a PyTorch `modeling_marin.py`, so `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` works.

`marinctl.hf.export` writes and reads the directory; `mapping` names every tensor; `config` writes the
architecture fields; `tokenizer` writes the tokenizer files; `modeling_marin.py` is copied verbatim into
every export (it imports torch, which marinctl itself never does).
"""
