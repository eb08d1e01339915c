"""The CLI: stage discovery, `plan` figures against docs/recipe.md §1, one-line user errors with exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from marinctl.cli import discover_stages, run

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"


def marinctl(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The installed console script, as a user or a scheduler runs it."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "marinctl.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=full_env,
        timeout=120,
    )


def test_plan_hero_reproduces_the_published_figures():
    result = marinctl("plan", str(RECIPES / "hero.toml"), "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    expected = {
        "matmul_params": 535.3e9,
        "total_params": 535.48e9,
        "active_params": 22.76e9,
        "train_flops": 2.70e24,
        "train_flops_excl_lm_head": 2.61e24,
        "warmup_steps": 3903,
        "adam_lr": 7.593e-4,
        "muonh_lr": 3.290e-3,
    }
    for key, value in expected.items():
        assert plan[key] == pytest.approx(value, rel=5e-3), key
    assert plan["steps"] == 390251 and plan["tokens_per_step"] == 46137344
    assert plan["capacity"]["pooled_sender"] == 3141 and plan["capacity"]["pooled_receiver"] == 33497
    required = {
        "total_params",
        "active_params",
        "flops_per_token",
        "train_flops",
        "train_flops_excl_lm_head",
        "tokens_per_step",
        "steps",
        "tokens",
        "warmup_steps",
        "adam_lr",
        "muonh_lr",
        "beta1",
        "beta2",
        "epsilon",
        "capacity",
    }
    assert required <= set(plan)


def test_plan_ladder_rungs_use_the_same_code():
    from marinctl.recipe import load_recipe
    from stages.plan import plan_summary

    previous = 0
    for rung in ("d768", "d1024", "d1536", "d2048"):
        summary = plan_summary(load_recipe(RECIPES / "ladder" / f"{rung}.toml"))
        assert summary["active_params"] > previous
        previous = summary["active_params"]
    assert summary["total_params"] == pytest.approx(27.7e9, rel=5e-3)  # "the 27.7B-A1.2B rung"
    assert summary["active_params"] == pytest.approx(1.17e9, rel=5e-3)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "recipes/tiny.toml", "--set", "moe.top_k=400"], "--set: moe.top_k: must be ≤ num_experts (got 400)"),
        (["plan", "missing.toml"], "missing.toml: no such recipe file"),
        (["plan", "recipes/tiny.toml", "--set", "moe.topk=4"], "--set: moe.topk: unknown key (did you mean 'top_k'?)"),
    ],
)
def test_user_errors_print_one_line_and_exit_2(args, message, capsys):
    assert run(args) == 2
    err = capsys.readouterr().err
    assert err.strip() == message
    assert "Traceback" not in err


def test_subprocess_user_error_has_no_traceback():
    result = marinctl("plan", "recipes/tiny.toml", "--set", "attention.window=100000")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == ["--set: attention.window: must be ≤ train.seq_len=256 (got 100000)"]


def test_version_and_help():
    assert marinctl("--version").stdout.strip().startswith("marinctl ")
    helped = marinctl("--help", env={"NO_COLOR": "1"})
    assert helped.returncode == 0 and "plan" in helped.stdout and "\x1b[" not in helped.stdout


def test_help_does_not_import_jax_or_scipy():
    """`--help` (and shell completion, on every TAB) imports every stage module, so none
    may pull in JAX or scipy at import (1.9 s of `marinctl --help` before, 0.35 s after)."""
    code = (
        "import sys\nfrom marinctl.cli import run\ntry:\n    run(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('jax', 'scipy', 'optax', 'equinox') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_stages_come_from_entry_points():
    names = {stage.name for stage in discover_stages()}
    assert "plan" in names
