"""stages/ladder.py end to end on run directories written here: the `--json` contract, the forecast,
the extrapolation report, the plot, and one-line user errors with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from marinctl.cli import run
from marinctl.ladder import PROGRESS_GRID, training_compute
from marinctl.recipe import load_recipe, recipe_to_toml

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "recipes"
HERO = RECIPES / "hero.toml"
E = 1.5
STEPS = {"d768": 100, "d1024": 120, "d1536": 140, "d2048": 160}  # small `--set train.steps` per rung


def law_A(g: float) -> float:
    return 60.0 + 90.0 * g


def law_alpha(g: float) -> float:
    return 0.07 + 0.03 * g


def law_loss(g: float, compute: float) -> float:
    return E + law_A(g) * (g * compute) ** -law_alpha(g)


def write_run_dir(root: Path, name: str, *, stop_fraction: float = 1.0) -> float:
    """A `marinctl train`-shaped run dir: the resolved recipe and eval records on the synthetic law at every
    5% of progress (plus step 0); returns the rung's compute."""
    steps = STEPS[name]
    recipe = load_recipe(RECIPES / "ladder" / f"{name}.toml", [f"train.steps={steps}"])
    compute = training_compute(recipe)
    run_dir = root / name
    run_dir.mkdir()
    (run_dir / "recipe.toml").write_text(recipe_to_toml(recipe))
    records = [{"kind": "eval", "step": 0, "macro_loss": 11.9}]
    for g in PROGRESS_GRID:
        if g <= stop_fraction + 1e-9:
            step = round(g * steps)
            records.append({"kind": "train", "step": step, "loss": 9.0})
            records.append({"kind": "eval", "step": step, "macro_loss": law_loss(step / steps, compute)})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return compute


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    """Four complete rungs on the law, and a copy of d1536 that crashed at 80% (the post's 81%)."""
    root = tmp_path_factory.mktemp("ladder")
    computes = {name: write_run_dir(root, name) for name in STEPS}
    crashed = tmp_path_factory.mktemp("crashed")
    write_run_dir(crashed, "d1536", stop_fraction=0.8)
    return root, computes, crashed / "d1536"


def fit_json(capsys, *args: str) -> dict:
    code = run(["ladder", "fit", *args, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_fit_json_forecasts_the_hero_at_2_61e24_on_the_law_of_its_rungs(ladder, capsys):
    root, computes, _ = ladder
    out = fit_json(capsys, *(str(root / n) for n in STEPS), "--target", str(HERO))
    assert {"forecast", "per_progress", "rungs", "extrapolated"} <= out.keys()
    target = out["target"]["compute"]
    assert target == pytest.approx(2.61e24, rel=5e-3)
    assert out["forecast"] == pytest.approx(law_loss(1.0, target), rel=1e-9)
    assert [r["name"] for r in out["rungs"]] == list(STEPS)  # ascending compute
    assert [r["compute"] for r in out["rungs"]] == [computes[n] for n in STEPS]
    assert [row["progress"] for row in out["per_progress"]] == list(PROGRESS_GRID)
    for row in out["per_progress"]:
        g = row["progress"]
        assert row["A"] == pytest.approx(law_A(g), rel=1e-8) and row["alpha"] == pytest.approx(law_alpha(g), rel=1e-8)
        assert row["forecast"] == pytest.approx(law_loss(g, target), rel=1e-9)
        assert row["losses"]["d768"] == pytest.approx(law_loss(g, computes["d768"]), rel=1e-12)
    assert out["extrapolated"] == [] and out["irreducible"] == E


def test_fit_states_which_rung_points_were_extrapolated(ladder, capsys):
    root, _, crashed = ladder
    out = fit_json(capsys, str(root / "d768"), str(root / "d1024"), str(crashed), "--target", str(HERO))
    [ext] = out["extrapolated"]
    assert ext["rung"] == "d1536" and ext["progress"] == [0.85, 0.9, 0.95, 1.0] and ext["window"] == [0.6, 0.8]
    rows = {row["progress"]: row for row in out["per_progress"]}
    assert rows[0.8]["extrapolated"] == [] and rows[0.85]["extrapolated"] == ["d1536"]
    assert [r["extended"] for r in out["rungs"]] == [False, False, True]

    code = run(["ladder", "fit", str(root / "d768"), str(root / "d1024"), str(crashed), "--target", str(HERO)])
    err = capsys.readouterr().err
    assert code == 0 and "extrapolated: d1536 stopped at g = 0.800; g = 0.85–1.00" in err
    assert "forecast for hero" in err

    code = run(["ladder", "fit", str(root / "d1024"), str(crashed), "--target", str(HERO), "--no-extend"])
    err = capsys.readouterr().err
    assert code == 2 and "no forecast at g = 1.00: only 1 rung(s) reach it" in err


def test_fit_irreducible_loss_changes_the_law(ladder, capsys):
    root, _, _ = ladder
    dirs = [str(root / n) for n in STEPS]
    out = fit_json(capsys, *dirs, "--target", str(HERO), "--irreducible", "1.4")
    assert out["irreducible"] == 1.4 and out["final_law"]["E"] == 1.4
    assert out["per_progress"][-1]["residual_rms"] > 1e-4  # the law was made with E = 1.5


def test_fit_writes_the_plot_as_a_png(ladder, capsys, tmp_path):
    root, _, crashed = ladder
    png = tmp_path / "ladder.png"
    fit_json(capsys, str(root / "d768"), str(root / "d1024"), str(crashed), "--target", str(HERO), "--plot", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(tmp_path.glob("*.tmp*"))


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("one", "needs at least 2 rung run directories (got 1)"),
        ("missing", "not a directory"),
        ("no_metrics", "no metrics.jsonl"),
        ("no_evals", "no eval records with a macro_loss"),
        ("bad_target", "no such recipe file"),
        ("below_E", "is not above the irreducible loss"),
        ("plot_dir", "does not exist"),
    ],
)
def test_fit_user_errors_print_one_line_and_exit_2(ladder, capsys, tmp_path, case, message):
    root, _, _ = ladder
    d768, d1024 = str(root / "d768"), str(root / "d1024")
    args = [d768, d1024, "--target", str(HERO)]
    if case == "one":
        args = [d768, "--target", str(HERO)]
    elif case == "missing":
        args = [d768, str(tmp_path / "nope"), "--target", str(HERO)]
    elif case in ("no_metrics", "no_evals"):
        bad = tmp_path / "bad"
        bad.mkdir()
        (bad / "recipe.toml").write_text((root / "d1024" / "recipe.toml").read_text())
        if case == "no_evals":
            (bad / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 0, "loss": 5.0}) + "\n")
        args = [d768, str(bad), "--target", str(HERO)]
    elif case == "bad_target":
        args = [d768, d1024, "--target", str(tmp_path / "hero.toml")]
    elif case == "below_E":
        args += ["--irreducible", "5"]
    elif case == "plot_dir":
        args += ["--plot", str(tmp_path / "no" / "such" / "dir.png")]
    code = run(["ladder", "fit", *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "\n" not in err and "Traceback" not in err


def test_efficiency_command_reports_compute_needed_by_the_baseline(capsys):
    args = ["--A", "88.90", "--alpha", "0.0941", "--E", "1.6", "--loss", "2.75", "--compute", "1e20", "--json"]
    code = run(["ladder", "efficiency", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = json.loads(captured.out)
    assert out["compute_needed"] == pytest.approx(1.163935778e20, rel=1e-9)
    assert out["efficiency"] == pytest.approx(1.163935778, rel=1e-9)
    assert out["baseline_loss"] == pytest.approx(2.766545710, rel=1e-9)
    code = run(["ladder", "efficiency", *args[:7], "1.6", "--compute", "1e20"])  # loss = E
    assert code == 2 and "above the irreducible loss" in capsys.readouterr().err


def test_ladder_is_registered_as_a_marinctl_stage():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "marinctl.cli",
            "ladder",
            "efficiency",
            "--A",
            "88.9",
            "--alpha",
            "0.0941",
            "--E",
            "1.6",
            "--loss",
            "2.75",
            "--compute",
            "1e20",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "compute efficiency 1.164×" in " ".join(result.stderr.split())
