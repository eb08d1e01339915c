"""The hf export in PyTorch: `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` gives the
JAX model's logits (f32, one packed-free sequence) through the exported `modeling_marin.py`.

PyTorch and transformers are an optional, multi-gigabyte extra (`pip install -e '.[torch]'`): the test
runs in-process when both import, or through another interpreter that has them when
MARINCTL_TORCH_PYTHON names one (e.g. a separate venv), and is skipped otherwise.
"""

import importlib.util
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

LOAD = """
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM

directory, ids_path, out_path = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, torch_dtype=torch.float32)
model.eval()
ids = torch.from_numpy(np.load(ids_path)).long()
with torch.no_grad():
    full = model(input_ids=ids).logits.numpy()
    # The same rows right-padded by 7 tokens, attention_mask 0 there: the padding must change nothing.
    padded = torch.cat([ids, torch.full((ids.shape[0], 7), 258)], dim=1)
    mask = torch.cat([torch.ones_like(ids), torch.zeros((ids.shape[0], 7), dtype=torch.long)], dim=1)
    masked = model(input_ids=padded, attention_mask=mask).logits[:, : ids.shape[1]].numpy()
    generated = model.generate(ids[:1, :20], max_new_tokens=4, do_sample=False).numpy()
np.savez(out_path, logits=full, masked=masked, generated=generated)
"""

IN_PROCESS = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("transformers") is not None
OTHER = os.environ.get("MARINCTL_TORCH_PYTHON", "")


@pytest.mark.skipif(
    not IN_PROCESS and not OTHER,
    reason="needs torch + transformers (pip install -e '.[torch]') or MARINCTL_TORCH_PYTHON=/path/to/python",
)
def test_transformers_loads_the_hf_export_and_matches_the_jax_logits(eco_run, tmp_path):
    from marinctl.export import inference_model, write_hf_export

    recipe, _, params, bias = eco_run
    out = tmp_path / "hf"
    write_hf_export(out, recipe, 5, params, bias)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 256, (2, 100)).astype(np.int64)  # > window (16): local and global layers differ
    np.save(tmp_path / "ids.npy", ids)
    model, _ = inference_model(recipe, {k: jnp.asarray(v) for k, v in params.items()})
    tokens = jnp.asarray(ids, jnp.int32)
    want = np.asarray(model(tokens, jnp.ones_like(tokens), jnp.asarray(bias))[0])

    python = sys.executable if IN_PROCESS else OTHER
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    subprocess.run([python, "-c", LOAD, str(out), str(tmp_path / "ids.npy"), str(tmp_path / "torch.npz")],
                   check=True, env=env, timeout=600)  # fmt: skip
    got = np.load(tmp_path / "torch.npz")
    scale = np.abs(want).max()
    rel = np.abs(got["logits"] - want).max() / scale
    print(f"max |torch - jax| / max |jax| = {rel:.2e} (max |logit| {scale:.2f})")
    assert rel < 1e-4
    np.testing.assert_allclose(got["masked"], got["logits"], rtol=0, atol=1e-5 * scale)
    # Greedy generation continues with the JAX model's argmax at every step.
    prefix = ids[0, :20].tolist()
    for _ in range(4):
        row = jnp.asarray([prefix], jnp.int32)
        prefix.append(int(np.argmax(np.asarray(model(row, jnp.ones_like(row), jnp.asarray(bias))[0])[0, -1])))
    assert got["generated"][0].tolist() == prefix
