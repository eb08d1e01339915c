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
