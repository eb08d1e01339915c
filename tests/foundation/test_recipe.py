"""Recipes: inheritance, typed overrides, and one-line errors that name the file and the field."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from marinctl.errors import RecipeError
from marinctl.recipe import Recipe, load_recipe, recipe_to_toml

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def child(tmp_path: Path, body: str, name: str = "child.toml") -> Path:
    return write(tmp_path, name, f'extends = "{RECIPES / "tiny.toml"}"\n{body}')


def error_of(path: Path, overrides: tuple[str, ...] = ()) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, overrides)
    message = str(info.value)
    assert "\n" not in message, "a recipe error is one line"
    return info.value


def test_tiny_extends_hero_and_overrides_only_what_differs(hero_recipe, tiny_recipe):
    assert tiny_recipe.model.hidden == 256 and hero_recipe.model.hidden == 6144
    # Inherited untouched from the hero:
    assert tiny_recipe.model.z_loss_weight == hero_recipe.model.z_loss_weight == 1e-4
    assert tiny_recipe.attention.qk_mult == 1.3 and tiny_recipe.moe.router_weight_sum == 2.5
    assert tiny_recipe.model.sconv_sites == ("keys", "attn_out", "mlp_out")


def test_hero_layer_pattern_has_12_global_36_local(hero_recipe):
    pattern = hero_recipe.layer_is_global()
    assert sum(pattern) == 12 and len(pattern) == 48
    assert all(pattern[i] == ((i + 1) % 4 == 0) for i in range(48))


def test_set_overrides_are_typed_by_the_schema(tmp_path):
    r = load_recipe(
        RECIPES / "tiny.toml",
        [
            "train.steps=7",
            "moe.capacity_factor=2",
            "attention.xsa=false",
            "model.sconv_sites=keys,mlp_out",
            "optimizer.adam_lr=0.01",
        ],
    )
    assert r.train.steps == 7 and isinstance(r.moe.capacity_factor, float) and r.moe.capacity_factor == 2.0
    assert r.attention.xsa is False and r.model.sconv_sites == ("keys", "mlp_out")
    assert r.optimizer.adam_lr == 0.01
    assert load_recipe(RECIPES / "tiny.toml", ["optimizer.adam_lr=auto"]).optimizer.adam_lr is None


def test_unknown_key_names_file_and_field_with_suggestion(tmp_path):
    path = child(tmp_path, "[moe]\ntop_kk = 3\n")
    err = error_of(path)
    assert str(err) == f"{path}: moe.top_kk: unknown key (did you mean 'top_k'?)"


def test_unknown_key_in_a_parent_names_the_parent(tmp_path):
    parent = write(tmp_path, "parent.toml", f'extends = "{RECIPES / "tiny.toml"}"\n[train]\nsteps_ = 3\n')
    path = write(tmp_path, "kid.toml", 'extends = "parent.toml"\n')
    assert str(error_of(path)).startswith(f"{parent}: train.steps_: unknown key")


def test_unknown_section(tmp_path):
    assert "unknown key (did you mean 'train'?)" in str(error_of(child(tmp_path, "[trian]\nsteps = 3\n")))


def test_wrong_type(tmp_path):
    path = child(tmp_path, '[train]\nsteps = "many"\n')
    assert str(error_of(path)) == f"{path}: train.steps: expected an integer (got 'many')"


def test_wrong_choice(tmp_path):
    err = error_of(child(tmp_path, '[moe]\ntransport = "carrier-pigeon"\n'))
    assert err.key == "moe.transport" and "'ragged'" in err.message


def test_out_of_range(tmp_path):
    err = error_of(child(tmp_path, "[attention]\nrope_fraction = 1.5\n"))
    assert err.key == "attention.rope_fraction" and err.message == "must be ≤ 1 (got 1.5)"


@pytest.mark.parametrize(
    ("body", "key", "fragment"),
    [
        ("[moe]\ntop_k = 400\n", "moe.top_k", "must be ≤ num_experts (got 400)"),
        ("[model]\nhidden = 250\n", "model.hidden", "divisible by model.head_dim"),
        ("[attention]\nlocal_kv_heads = 3\n", "attention.local_kv_heads", "must divide model.num_heads"),
        ("[parallel]\nexpert = 3\n", "parallel.expert", "must divide moe.num_experts=16"),
        ("[attention]\nwindow = 4096\n", "attention.window", "must be ≤ train.seq_len=256"),
        ("[train]\ngrad_accum = 5\n", "train.grad_accum", "must divide train.batch_size"),
        ("[eval]\nsources = ['nope']\n", "eval.sources[0]", "no such data source 'nope'"),
    ],
)
def test_cross_field_rules(tmp_path, body, key, fragment):
    err = error_of(child(tmp_path, body))
    assert err.key == key and fragment in err.message and err.source.endswith("child.toml")


def test_set_error_names_the_flag(tmp_path):
    err = error_of(RECIPES / "tiny.toml", ("moe.top_k=400",))
    assert str(err) == "--set: moe.top_k: must be ≤ num_experts (got 400)"
    assert "unknown key (did you mean 'steps'?)" in str(error_of(RECIPES / "tiny.toml", ("train.step=3",)))


def test_missing_file(tmp_path):
    assert str(error_of(tmp_path / "nope.toml")) == f"{tmp_path / 'nope.toml'}: no such recipe file"
    path = write(tmp_path, "a.toml", 'extends = "missing.toml"\n')
    assert "extends: no such recipe file" in str(error_of(path))


def test_invalid_toml(tmp_path):
    assert "invalid TOML" in str(error_of(write(tmp_path, "bad.toml", "[model\nhidden = 3\n")))


def test_extends_cycle(tmp_path):
    write(tmp_path, "a.toml", 'extends = "b.toml"\n')
    write(tmp_path, "b.toml", 'extends = "a.toml"\n')
    err = error_of(tmp_path / "a.toml")
    assert err.key == "extends" and "cycle in extends (a.toml -> b.toml -> a.toml)" in err.message


def test_ladder_steps_follow_the_791_rule():
    from marinctl.counting import count_params

    for rung in ("d768", "d1024", "d1536", "d2048"):
        r = load_recipe(RECIPES / "ladder" / f"{rung}.toml")
        active = count_params(r).active
        assert r.train.steps == round(791 * active / r.tokens_per_step)
        assert r.tokens_per_step == r.parallel.replica * 1024 * 4096
        assert r.moe.expert_width == r.moe.latent_width == r.moe.shared_width == r.model.hidden // 2


def test_resolved_recipe_round_trips_through_toml(tmp_path, tiny_recipe):
    path = write(tmp_path, "resolved.toml", recipe_to_toml(tiny_recipe))
    again = load_recipe(path)
    assert dataclasses.replace(again, source="x") == dataclasses.replace(tiny_recipe, source="x")
    assert isinstance(again, Recipe)
