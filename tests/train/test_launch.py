"""Launch checks: the hero's dry run on this machine, and fail-fast errors before anything is allocated."""

import json
from pathlib import Path

from marinctl.cli import run
from marinctl.counting import BYTES_F32
from marinctl.params import param_table, shard_size
from marinctl.recipe import load_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
HERO, TINY = str(RECIPES / "hero.toml"), str(RECIPES / "tiny.toml")


def test_dry_run_builds_the_hero_state_abstractly_with_exact_per_device_bytes(capsys):
    assert run(["train", HERO, "--dry-run", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["devices"] == 704 and report["mesh"] == {"replica": 11, "data": 1, "expert": 64}
    hero = load_recipe(HERO)
    mesh = report["mesh"]
    # Independent of the dry run's path (NamedSharding.shard_shape on eval_shape leaves): the table's rule.
    params = sum(shard_size(spec, mesh) for spec in param_table(hero).values()) * BYTES_F32
    assert report["per_device_bytes"]["params"] == params
    # Muon keeps one fp32 slot per element, Adam/AdamH two; hyperball norms and counts are tiny.
    slots = sum(shard_size(s, mesh) * (1 if s.group == "muonh" else 2) for s in param_table(hero).values())
    assert 0 <= report["per_device_bytes"]["optimizer"] - slots * BYTES_F32 < 2**20
    assert report["state_bytes_total"] > 535e9 * 4 * 2  # parameters plus at least one slot each


def test_a_recipe_needing_more_devices_fails_fast_with_its_mesh_and_memory(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert run(["train", HERO, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "replica=11 x data=1 x expert=64 needs 704 devices, 8 present" in err
    assert "GiB" in err and "--dry-run" in err
    assert not run_dir.exists()  # nothing written, nothing allocated


def test_a_batch_that_does_not_split_over_the_devices_is_a_user_error(tmp_path, capsys):
    code = run(["train", TINY, "--run-dir", str(tmp_path / "r"), "--set", "train.batch_size=12"])
    assert code == 2
    assert "12 rows per micro-batch do not split over 8 devices" in capsys.readouterr().err


def test_state_that_cannot_fit_device_memory_fails_fast_naming_the_figures(monkeypatch):
    import jax
    import pytest

    from marinctl.errors import UserError
    from marinctl.train import launch

    recipe = load_recipe(TINY)
    monkeypatch.setattr(launch, "device_memory_bytes", lambda device, n: 1 << 20)  # a 1 MiB device
    with pytest.raises(UserError, match=r"per device on mesh replica=1 x data=8 x expert=1, but a cpu device"):
        launch.check_fits(recipe, jax.devices())
    monkeypatch.setattr(launch, "device_memory_bytes", lambda device, n: 1 << 40)
    assert launch.check_fits(recipe, jax.devices()) == {"replica": 1, "data": 8, "expert": 1}


def test_eval_rows_that_do_not_split_explain_the_context_change_only_after_one():
    import pytest

    from marinctl.errors import UserError
    from marinctl.schedule import at_context
    from marinctl.train.launch import check_eval_rows

    tiny = load_recipe(TINY)  # eval.batch_size 16 at seq_len 256
    clause = "a context change keeps eval tokens per batch"
    with pytest.raises(UserError, match="16 rows at seq_len 256 do not split over 3 devices") as err:
        check_eval_rows(tiny, 3, first_seq_len=256)
    assert clause not in str(err.value)
    longer = at_context(tiny, 1024)  # 16 x 256 tokens held: 4 rows of 1,024
    with pytest.raises(UserError, match=rf"4 rows at seq_len 1024 \({clause}\) do not split over 3 devices"):
        check_eval_rows(longer, 3, where="--seq-len 1024", first_seq_len=256)
    check_eval_rows(longer, 2, first_seq_len=256)  # 4 rows split over 2 devices
