"""stages/export.py and marinctl/export.py: a checkpoint as safetensors + config.json + recipe.toml."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy

import marinctl.export
from marinctl.cli import run as cli
from marinctl.export import load_export
from marinctl.model.transformer import build_model
from marinctl.params import param_table
from marinctl.recipe import load_recipe, recipe_to_dict


def stored_state(run_dir, step):
    """Oracle: the whole saved train state, read with plain orbax."""
    restored = ocp.StandardCheckpointer().restore((run_dir / "checkpoints" / str(step) / "state").absolute())
    return {k: np.asarray(v) for k, v in restored.items()}


def bfloat16_bits(x):
    """Oracle: fp32 -> bf16 bit patterns by round-to-nearest-even on the raw bits (finite inputs)."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def export_json(capsys, run_dir, out, *args):
    rc = cli(["export", str(run_dir), "--out", str(out), *map(str, args), "--json"])
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(stdout)


def siblings(directory):
    """Everything beside `directory` in its parent: a leftover staging dir would show here."""
    return sorted(p.name for p in directory.parent.iterdir())


@pytest.fixture(scope="module")
def exported(trained_run, tmp_path_factory):
    _, run_dir = trained_run
    out = tmp_path_factory.mktemp("export") / "micro"
    assert cli(["export", str(run_dir), "--out", str(out), "--quiet"]) == 0
    return out


def test_export_round_trip_rebuilds_a_model_with_identical_logits(trained_run, exported):
    recipe, run_dir = trained_run
    tensors = safetensors.numpy.load_file(exported / "model.safetensors")
    table = param_table(recipe)
    assert set(tensors) == {*table, "router_bias"}
    for path, spec in table.items():  # one tensor per table path, layer-stacked, fp32 master weights
        assert tensors[path].shape == spec.shape and tensors[path].dtype == np.float32
    router_bias = tensors.pop("router_bias")
    saved = stored_state(run_dir, 2)
    np.testing.assert_array_equal(router_bias, saved["router_bias"])

    from marinctl.data.loader import Loader

    batch = {k: jnp.asarray(v[:2]) for k, v in Loader(recipe).batch(0).items()}
    dense = recipe.replace(moe=dataclasses.replace(recipe.moe, transport="dense"))  # no mesh needed
    forward = jax.jit(lambda model, bias: model(batch["tokens"], batch["segment_ids"], bias)[0])
    checkpointed = build_model(dense, {p: saved[f"model.{p}"] for p in table})
    reloaded = build_model(load_recipe(exported / "recipe.toml").replace(moe=dense.moe), tensors)
    want = np.asarray(forward(checkpointed, saved["router_bias"]))
    got = np.asarray(forward(reloaded, router_bias))
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(got, want)


def test_export_config_documents_architecture_rope_router_bias_and_tensors(trained_run, exported):
    recipe, _ = trained_run
    config = json.loads((exported / "config.json").read_text())
    sections = recipe_to_dict(recipe)
    assert config["format"] == "marinctl" and config["step"] == 2 and config["dtype"] == "float32"
    for section in ("model", "attention", "moe"):
        assert config[section] == sections[section]
    assert config["layer_is_global"] == [False, True]
    assert config["rope"]["convention"] == "split_halves"
    assert config["rope"]["rotary_dims"] == 16  # head_dim 32 x rope_fraction 0.5
    assert config["router_bias"]["tensor"] == "router_bias" and config["router_bias"]["shape"] == [2, 8]
    with safetensors.safe_open(exported / "model.safetensors", "np") as f:
        assert f.metadata() == {"format": "marinctl", "format_version": "1", "step": "2", "dtype": "float32"}
        for path, info in config["tensors"].items():
            assert f.get_slice(path).get_shape() == info["shape"]
            assert len(info["axes"]) == len(info["shape"])
    assert recipe_to_dict(load_recipe(exported / "recipe.toml")) == sections


def test_load_export_is_the_inverse_of_the_export(trained_run, exported):
    recipe, run_dir = trained_run
    back = load_export(exported)
    saved = stored_state(run_dir, 2)
    assert recipe_to_dict(back.recipe) == recipe_to_dict(recipe) and back.config["step"] == 2
    for path, value in back.params.items():
        np.testing.assert_array_equal(value, saved[f"model.{path}"])
    np.testing.assert_array_equal(back.router_bias, saved["router_bias"])


def test_bfloat16_export_rounds_parameters_and_keeps_the_router_bias_fp32(trained_run, tmp_path, capsys):
    _, run_dir = trained_run
    summary = export_json(capsys, run_dir, tmp_path / "bf16", "--dtype", "bfloat16", "--step", 1)
    assert summary["step"] == 1 and summary["dtype"] == "bfloat16" and summary["tensors"] == 19
    tensors = safetensors.numpy.load_file(tmp_path / "bf16" / "model.safetensors")
    saved = stored_state(run_dir, 1)
    for path, value in tensors.items():
        if path == "router_bias":
            assert value.dtype == np.float32
            np.testing.assert_array_equal(value, saved["router_bias"])
        else:
            assert value.dtype == jnp.bfloat16
            np.testing.assert_array_equal(value.view(np.uint16), bfloat16_bits(saved[f"model.{path}"]))


def test_export_never_overwrites_without_the_flag_and_replaces_whole_with_it(trained_run, tmp_path, capsys):
    _, run_dir = trained_run
    out = tmp_path / "model"
    export_json(capsys, run_dir, out, "--step", 1)
    first = (out / "model.safetensors").read_bytes()

    assert cli(["export", str(run_dir), "--out", str(out)]) == 2
    _, err = capsys.readouterr()
    assert "already exists; pass --overwrite" in err and len(err.strip().splitlines()) == 1
    assert (out / "model.safetensors").read_bytes() == first

    (out / "stale.txt").write_text("from an older export")
    summary = export_json(capsys, run_dir, out, "--overwrite")
    assert summary["step"] == 2 and json.loads((out / "config.json").read_text())["step"] == 2
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "recipe.toml"]
    assert (out / "model.safetensors").read_bytes() != first
    assert siblings(out) == ["model"]  # no staging or retired directory left behind


def test_a_failed_write_leaves_neither_a_partial_export_nor_a_damaged_old_one(trained_run, tmp_path, monkeypatch):
    recipe, run_dir = trained_run
    from marinctl.restore import restore_weights

    weights = restore_weights(recipe, run_dir)
    out = tmp_path / "model"

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.numpy, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        marinctl.export.write_export(out, recipe, weights.step, weights.params, weights.router_bias)
    assert siblings(out) == []
    monkeypatch.undo()

    marinctl.export.write_export(out, recipe, weights.step, weights.params, weights.router_bias)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr(safetensors.numpy, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        marinctl.export.write_export(out, recipe, 1, weights.params, weights.router_bias, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and siblings(out) == ["model"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{run}", "--out", "{file}"], "exists and is not a directory"),
        (["{run}", "--out", "{under_file}"], "cannot create"),
        (["{run}", "--out", "{new}", "--dtype", "float16"], "--dtype 'float16': choose one of float32, bfloat16"),
        (["{run}", "--out", "{new}", "--step", "9"], "no checkpoint at step 9 (available: 1, 2)"),
        (["{missing}", "--out", "{new}"], "no such run directory"),
    ],
)
def test_export_mistakes_exit_2_with_one_line_and_write_nothing(trained_run, tmp_path, capsys, args, message):
    _, run_dir = trained_run
    (tmp_path / "a_file").write_text("keep me")
    paths = {
        "run": run_dir, "file": tmp_path / "a_file", "under_file": tmp_path / "a_file" / "out",
        "new": tmp_path / "new", "missing": tmp_path / "missing",
    }  # fmt: skip
    rc = cli(["export", *(a.format(**paths) for a in args)])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"] and (tmp_path / "a_file").read_text() == "keep me"


# --------------------------------------------------------------------------------------------------
# --format hf: a Hugging Face–style directory, and `marinctl import` back.


def hf_files(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def hf_exported(trained_run, tmp_path_factory):
    _, run_dir = trained_run
    out = tmp_path_factory.mktemp("hf") / "micro-hf"
    assert cli(["export", str(run_dir), "--out", str(out), "--format", "hf", "--quiet"]) == 0
    return out


def test_hf_export_has_per_layer_out_in_tensors_under_the_documented_names(trained_run, hf_exported):
    recipe, run_dir = trained_run
    saved = stored_state(run_dir, 2)
    t = safetensors.numpy.load_file(hf_exported / "model.safetensors")
    m, moe = recipe.model, recipe.moe
    D, V, E, I, l = m.hidden, m.vocab_size, moe.num_experts, moe.expert_width, moe.latent_width
    K = m.sconv_kernel
    np.testing.assert_array_equal(t["model.embed_tokens.weight"], saved["model.embed.weight"])  # [V, D]
    np.testing.assert_array_equal(t["lm_head.weight"], saved["model.lm_head.weight"].T)  # [V, D]
    assert t["lm_head.weight"].shape == (V, D)
    for i in range(m.num_layers):
        p = f"model.layers.{i}."
        w = lambda path, i=i: saved[f"model.{path}"][i]  # noqa: E731
        np.testing.assert_array_equal(t[p + "self_attn.q_proj.weight"], w("blocks.attention.w_q").T)
        np.testing.assert_array_equal(t[p + "self_attn.o_proj.weight"], w("blocks.attention.w_o").T)
        np.testing.assert_array_equal(t[p + "self_attn.gate_proj.weight"], w("blocks.attention.w_gate").T)
        assert t[p + "self_attn.gate_proj.weight"].shape == (m.num_heads, D)
        np.testing.assert_array_equal(t[p + "input_norm.weight"], w("blocks.attn_norm.gain"))
        np.testing.assert_array_equal(t[p + "post_attention_norm.weight"], w("blocks.mlp_norm.gain"))
        np.testing.assert_array_equal(t[p + "mlp.router.weight"], w("blocks.moe.router").T)  # [E, D]
        np.testing.assert_array_equal(t[p + "mlp.router.bias"], saved["router_bias"][i])  # [E], fp32
        np.testing.assert_array_equal(t[p + "mlp.latent_down_proj.weight"], w("blocks.moe.latent_down").T)
        assert t[p + "mlp.latent_down_proj.weight"].shape == (l, D)
        assert t[p + "mlp.latent_up_proj.weight"].shape == (D, l)
        np.testing.assert_array_equal(t[p + "mlp.latent_norm.weight"], w("blocks.moe.latent_norm.gain"))
        for e in range(E):
            np.testing.assert_array_equal(t[p + "mlp.experts.gate_proj.weight"][e], w("blocks.moe.experts.w_gate")[e].T)
            np.testing.assert_array_equal(t[p + "mlp.experts.down_proj.weight"][e], w("blocks.moe.experts.w_down")[e].T)
        assert t[p + "mlp.experts.up_proj.weight"].shape == (E, I, l)
        assert t[p + "mlp.experts.down_proj.weight"].shape == (E, l, I)
    assert not any(".shared_experts." in k or "conv" in k or "gated_norm" in k for k in t)  # micro has them off
    assert t["model.layers.0.mlp.router.bias"].dtype == np.float32 and K > 0


def test_hf_config_carries_the_architecture_and_what_transformers_needs(trained_run, hf_exported):
    recipe, _ = trained_run
    config = json.loads((hf_exported / "config.json").read_text())
    assert config["model_type"] == "marin" and config["architectures"] == ["MarinForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_marin.MarinForCausalLM"
    m, a, moe = recipe.model, recipe.attention, recipe.moe
    want = {
        "num_attention_heads": m.num_heads, "head_dim": m.head_dim, "num_hidden_layers": m.num_layers,
        "num_key_value_heads_local": a.local_kv_heads, "num_key_value_heads_global": a.global_kv_heads,
        "global_layers": [i for i, g in enumerate(recipe.layer_is_global()) if g], "sliding_window": a.window,
        "rope_theta": a.rope_theta, "partial_rotary_factor": a.rope_fraction, "rope_pairing": "half",
        "qk_mult": a.qk_mult, "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
        "num_shared_experts": moe.shared_experts, "routed_scaling_factor": moe.router_weight_sum,
        "rms_norm_eps": m.norm_eps, "qk_norm_eps": a.qk_norm_eps, "xsa": a.xsa, "vocab_size": m.vocab_size,
        "hidden_size": m.hidden,
    }  # fmt: skip
    assert {k: config[k] for k in want} == want
    assert config["marinctl"]["step"] == 2 and config["bos_token_id"] == 256 and config["eos_token_id"] == 257
    generation = json.loads((hf_exported / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 257 and generation["do_sample"] is False
    names = {p.name for p in hf_exported.iterdir()}
    assert {"modeling_marin.py", "tokenizer.json", "tokenizer_config.json", "recipe.toml"} <= names
    compile((hf_exported / "modeling_marin.py").read_text(), "modeling_marin.py", "exec")


def test_hf_byte_tokenizer_matches_marinctls_and_round_trips_utf8(hf_exported):
    from tokenizers import Tokenizer

    from marinctl.data.tokenizer import ByteTokenizer

    tok = Tokenizer.from_file(str(hf_exported / "tokenizer.json"))
    text = "naïve café → 日本語 🙂\n\tdef f(x): return x ** 2\r\n"
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == ByteTokenizer().encode_batch([text])[0].tolist()
    assert tok.decode(ids) == text
    assert tok.encode("ab").ids == [256, 97, 98]  # transformers' default adds <bos>, as documents were trained
    assert [tok.token_to_id(s) for s in ("<bos>", "<eos>", "<pad>")] == [256, 257, 258]


def test_hf_export_shards_past_the_size_with_an_index(trained_run, hf_exported, tmp_path, capsys):
    from marinctl.hf.export import load_hf_export

    _, run_dir = trained_run
    summary = export_json(capsys, run_dir, tmp_path / "sharded", "--format", "hf", "--max-shard-size", "20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for name in files:
        size = (tmp_path / "sharded" / name).stat().st_size
        assert size <= 20_000 + 4096 or len(safetensors.numpy.load_file(tmp_path / "sharded" / name)) == 1
    assert not (tmp_path / "sharded" / "model.safetensors").exists() and summary["format"] == "hf"
    one, many = load_hf_export(hf_exported), load_hf_export(tmp_path / "sharded")
    assert one.params.keys() == many.params.keys()
    for k in one.params:
        np.testing.assert_array_equal(one.params[k], many.params[k])


@pytest.mark.parametrize("extra", [(), ("--dtype", "bfloat16", "--max-shard-size", "30KB")])
def test_export_import_export_is_byte_identical(trained_run, tmp_path, capsys, extra):
    _, run_dir = trained_run
    first, second, run = tmp_path / "first", tmp_path / "second", tmp_path / "imported"
    export_json(capsys, run_dir, first, "--format", "hf", "--step", 1, *extra)
    assert cli(["import", str(first), "--run-dir", str(run), "--step", "1", "-q"]) == 0
    export_json(capsys, run, second, "--format", "hf", *extra)
    a, b = hf_files(first), hf_files(second)
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a), [k for k in a if a[k] != b.get(k)]


def test_an_imported_run_is_a_run_the_trainer_resumes(trained_run, tmp_path, capsys):
    """The imported checkpoint restores into the trainer's own abstract state (every leaf, its shape)."""
    from marinctl.routing.mesh import make_mesh
    from marinctl.train.checkpoint import Checkpoints
    from marinctl.train.state import abstract_state, make_optimizer, state_shardings, with_shardings

    recipe, run_dir = trained_run
    export_json(capsys, run_dir, tmp_path / "hf", "--format", "hf")
    assert cli(["import", str(tmp_path / "hf"), "--run-dir", str(tmp_path / "run"), "--step", "7", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 7
    imported = load_recipe(tmp_path / "run" / "recipe.toml")
    assert recipe_to_dict(imported) == recipe_to_dict(recipe)
    optimizer = make_optimizer(imported)
    mesh = make_mesh(imported.parallel, jax.devices())
    abstract = with_shardings(abstract_state(imported, optimizer), state_shardings(imported, optimizer, mesh))
    checkpoints = Checkpoints(tmp_path / "run" / "checkpoints", imported.checkpoint)
    try:
        with jax.set_mesh(mesh):
            restored = checkpoints.restore_latest(abstract)
    finally:
        checkpoints.close()
    saved = stored_state(run_dir, 2)
    assert restored.step == 7 and int(restored.state["step"]) == 7
    np.testing.assert_array_equal(np.asarray(restored.state["router_bias"]), saved["router_bias"])
    for path in param_table(recipe):
        np.testing.assert_array_equal(np.asarray(restored.state[f"model.{path}"]), saved[f"model.{path}"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["export", "{run}", "--out", "{new}", "--format", "gguf"], "--format 'gguf': choose one of native, hf"),
        (
            ["export", "{run}", "--out", "{new}", "--format", "hf", "--set", "data.tokenizer={missing}"],
            "no such tokenizer file",
        ),
        (["export", "{run}", "--out", "{new}", "--format", "hf", "--max-shard-size", "lots"], "--max-shard-size"),
        (["import", "{run}", "--run-dir", "{new}"], "not a marinctl hf export"),
        (["import", "{missing}", "--run-dir", "{new}"], "no such export directory"),
        (["import", "{hf}", "--run-dir", "{run}"], "exists and is not empty"),
        (["import", "{tampered}", "--run-dir", "{new}"], "num_experts = 9 disagrees with recipe.toml"),
    ],
)
def test_hf_mistakes_exit_2_with_one_line_and_write_nothing(trained_run, hf_exported, tmp_path, capsys, args, message):
    import shutil

    _, run_dir = trained_run
    tampered = tmp_path / "tampered"
    shutil.copytree(hf_exported, tampered)
    config = json.loads((tampered / "config.json").read_text())
    (tampered / "config.json").write_text(json.dumps({**config, "num_experts": 9}))
    paths = {"run": run_dir, "new": tmp_path / "new", "missing": tmp_path / "missing", "hf": hf_exported,
             "tampered": tampered}  # fmt: skip
    rc = cli([a.format(**paths) for a in args])
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tampered"]
