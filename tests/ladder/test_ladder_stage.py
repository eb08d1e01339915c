"""stages/ladder.py end to end on run directories written here: the `--json` contract, the forecast,
the extrapolation report, the plot, and one-line user errors with exit 2."""

from __future__ import annotations

import json
import os
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


def test_fit_with_a_fitted_irreducible_loss_finds_the_floor_the_rungs_were_made_with(ladder, capsys):
    root, _, _ = ladder
    dirs = [str(root / n) for n in STEPS]
    out = fit_json(capsys, *dirs, "--target", str(HERO), "--irreducible", "fit")
    assert out["irreducible_fitted"] and out["irreducible"] == pytest.approx(E, abs=0.05)
    for bad, message in (("abc", "expected a number or 'fit'"), ("-1", "must be a finite number ≥ 0")):
        assert run(["ladder", "fit", *dirs, "--target", str(HERO), "--irreducible", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert f"--irreducible: {message}" in err and "\n" not in err


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


# --------------------------------------------------------------------------------------------------
# The forecast as an artifact, the rung/target checks, efficiency against a saved law.


def test_fit_out_writes_the_forecast_curve_that_train_refuses_for_another_target(ladder, capsys, tmp_path):
    from marinctl.errors import UserError
    from marinctl.forecast import read_forecast

    root, _, _ = ladder
    path = tmp_path / "forecast.json"
    out = fit_json(capsys, *(str(root / n) for n in STEPS), "--target", str(HERO), "--out", str(path))
    forecast = read_forecast(path)
    assert forecast.progress == PROGRESS_GRID and forecast.target["name"] == "hero"
    assert list(forecast.loss) == [row["forecast"] for row in out["per_progress"]]
    assert forecast.at(1.0) == out["forecast"] and forecast.at(0.0) is None
    assert forecast.at(0.525) == pytest.approx(
        (out["per_progress"][9]["forecast"] + out["per_progress"][10]["forecast"]) / 2
    )
    forecast.check_target(load_recipe(HERO))  # its own target
    with pytest.raises(UserError, match="a forecast for 'hero'"):
        forecast.check_target(load_recipe(RECIPES / "ladder" / "d768.toml"))

    run_dir = tmp_path / "run"
    code = run(["train", str(RECIPES / "ladder" / "d768.toml"), "--forecast", str(path), "--run-dir", str(run_dir)])
    # In-process, JAX has already started, so the rung's [runtime] section logs that it applies to new processes
    # only; a real `marinctl train` process does not print that line.
    lines = [ln for ln in capsys.readouterr().err.strip().splitlines() if "JAX already started" not in ln]
    assert code == 2 and len(lines) == 1 and "a forecast for 'hero' (compute" in lines[0]
    assert not run_dir.exists()  # refused before anything was written
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    code = run(["train", str(HERO), "--forecast", str(bad), "--run-dir", str(run_dir)])
    assert code == 2 and "not a marinctl forecast file" in capsys.readouterr().err


def _copy_rung(src: Path, dst: Path, **changes) -> Path:
    """A copy of a rung run dir whose saved recipe differs from the original in `section.key=value`s."""
    dst.mkdir()
    (dst / "metrics.jsonl").write_text((src / "metrics.jsonl").read_text())
    recipe = load_recipe(src / "recipe.toml", [f"{k.replace('__', '.')}={v}" for k, v in changes.items()])
    (dst / "recipe.toml").write_text(recipe_to_toml(recipe))
    return dst


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"data__tokenizer": "other/tokenizer.json"}, "data.tokenizer is 'other/tokenizer.json'"),
        ({"train__seq_len": 8192}, "train.seq_len is 8192, the target's is 4096"),
    ],
)
def test_fit_refuses_a_rung_that_is_not_a_rung_of_the_target(ladder, capsys, tmp_path, change, message):
    root, _, _ = ladder
    odd = _copy_rung(root / "d1024", tmp_path / "d1024", **change)
    code = run(["ladder", "fit", str(root / "d768"), str(odd), "--target", str(HERO)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "not a ladder rung of hero" in err and message in err and "\n" not in err


def test_fit_refuses_a_run_dir_without_evals_at_the_grid_points(ladder, capsys, tmp_path):
    root, _, _ = ladder
    sparse = tmp_path / "d1024"
    sparse.mkdir()
    (sparse / "recipe.toml").write_text((root / "d1024" / "recipe.toml").read_text())
    evals = [{"kind": "eval", "step": s, "macro_loss": v} for s, v in ((0, 11.9), (120, 3.0))]  # start and end only
    (sparse / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    code = run(["ladder", "fit", str(root / "d768"), str(sparse), "--target", str(HERO)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "no eval at or near the 5% grid point (step 6 of 120)" in err and "\n" not in err


def test_efficiency_reads_a_saved_law_and_a_variant_run_dir(ladder, capsys, tmp_path):
    root, computes, _ = ladder
    law = tmp_path / "forecast.json"
    fit_json(capsys, *(str(root / n) for n in STEPS), "--target", str(HERO), "--out", str(law))
    # A rung on the law needs exactly its own compute: efficiency 1.
    code = run(["ladder", "efficiency", str(root / "d1024"), "--law", str(law), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = json.loads(captured.out)
    assert out["compute"] == computes["d1024"] and out["E"] == E
    assert out["efficiency"] == pytest.approx(1.0, rel=1e-9)
    # A variant 0.01 nats better at the same compute: the law needs more compute to get there.
    code = run(["ladder", "efficiency", "--law", str(law), "--loss", str(out["loss"] - 0.01), "--compute",
                str(computes["d1024"]), "--json"])  # fmt: skip
    better = json.loads(capsys.readouterr().out)
    a, alpha = better["A"], better["alpha"]
    assert better["efficiency"] == pytest.approx((a / (out["loss"] - 0.01 - E)) ** (1 / alpha) / computes["d1024"])
    assert better["efficiency"] > 1
    for args, message in (
        (["--law", str(tmp_path / "none.json"), "--loss", "3", "--compute", "1"], "no such file"),
        (["--loss", "3", "--compute", "1"], "no baseline law"),
        (["--law", str(law)], "no variant"),
    ):
        assert run(["ladder", "efficiency", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err


# --------------------------------------------------------------------------------------------------
# `ladder run`: checks before training, the SLURM submission (a fake sbatch), skipping and fitting.

CPU = RECIPES / "ladder-cpu"
CPU_RUNGS = ("d16", "d32", "d32-l3", "d48")


def cpu_law(g: float, compute: float) -> float:
    return 1.0 + 40.0 * (g * compute) ** -0.09


def write_cpu_rung(root: Path, name: str) -> None:
    """A finished CPU-ladder rung dir with evals at its grid steps on `cpu_law` (no training)."""
    from marinctl.ladder import step_progress

    recipe = load_recipe(CPU / f"{name}.toml")
    steps, compute = recipe.train.steps, training_compute(recipe)
    run_dir = root / name
    run_dir.mkdir(parents=True)
    (run_dir / "recipe.toml").write_text(recipe_to_toml(recipe))
    grid = sorted({0, *(round(g * steps) for g in PROGRESS_GRID)})
    records = [
        {"kind": "eval", "step": s, "macro_loss": 5.6 if s == 0 else cpu_law(step_progress(s, steps), compute)}
        for s in grid
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """`sbatch` and `squeue` on PATH that record their calls: job ids 101, 102, …; squeue lists them all."""
    bin_dir, log = tmp_path / "bin", tmp_path / "slurm.log"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        f'#!/bin/sh\necho "sbatch $*" >> {log}\nn=$(grep -c ^sbatch {log})\necho "$((100 + n));cluster"\n'
    )
    (bin_dir / "squeue").write_text(f'#!/bin/sh\necho "squeue $*" >> {log}\necho RUNNING\n')
    for tool in ("sbatch", "squeue"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return log


def test_ladder_run_sbatch_writes_requeueable_jobs_then_fits_the_finished_rungs(fake_slurm, capsys, tmp_path):
    root = tmp_path / "ladder"
    rungs = [str(CPU / f"{n}.toml") for n in CPU_RUNGS]
    target = str(CPU / "target.toml")
    write_cpu_rung(root, "d16")  # finished already: skipped, not submitted
    code = run(["ladder", "run", *rungs, "--root", str(root), "--target", target, "--sbatch",
                "--sbatch-arg", "--partition=cpu", "--json"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = json.loads(captured.out)
    assert [(r["name"], r["status"], r["job_id"]) for r in out["rungs"]] == [
        ("d16", "done", None), ("d32", "submitted", "101"), ("d32-l3", "submitted", "102"), ("d48", "submitted", "103")
    ]  # fmt: skip
    assert out["fit"] is None  # three rungs still to train
    assert fake_slurm.read_text().splitlines() == [f"sbatch --parsable {root / n}.sbatch" for n in CPU_RUNGS[1:]]
    assert json.loads((root / "jobs.json").read_text()) == {"d32": "101", "d32-l3": "102", "d48": "103"}
    script = (root / "d48.sbatch").read_text()
    assert "#SBATCH --requeue\n" in script and "#SBATCH --partition=cpu\n" in script
    assert f"#SBATCH --output={root}/d48.slurm-%j.out" in script
    assert f"-m marinctl.cli train {CPU / 'd48.toml'} --run-dir {root / 'd48'} &" in script
    assert 'if [ "$rc" -eq 3 ]; then scontrol requeue "$SLURM_JOB_ID"; fi' in script
    assert subprocess.run(["bash", "-n", str(root / "d48.sbatch")]).returncode == 0

    # Again while the jobs are queued: nothing is resubmitted.
    code = run(["ladder", "run", *rungs, "--root", str(root), "--sbatch", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and [r["status"] for r in out["rungs"]] == ["done", "queued", "queued", "queued"]
    assert sum(line.startswith("sbatch") for line in fake_slurm.read_text().splitlines()) == 3

    # The jobs finished: every rung is skipped and the ladder is fit; the forecast file is for the target.
    for name in CPU_RUNGS[1:]:
        write_cpu_rung(root, name)
    code = run(["ladder", "run", *rungs, "--root", str(root), "--target", target, "--sbatch", "--irreducible", "1",
                "--json"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = json.loads(captured.out)
    assert [r["status"] for r in out["rungs"]] == ["done"] * 4
    target_compute = training_compute(load_recipe(target))
    assert out["fit"]["forecast"] == pytest.approx(cpu_law(1.0, target_compute), rel=1e-3)
    assert out["fit"]["target"]["compute"] == target_compute
    assert out["fit"]["per_progress"][9]["alpha"] == pytest.approx(0.09, rel=1e-3)
    assert (root / "ladder.png").read_bytes()[:4] == b"\x89PNG"
    from marinctl.forecast import read_forecast

    read_forecast(root / "forecast.json").check_target(load_recipe(target))


def test_ladder_run_sbatch_without_sbatch_on_path_is_a_user_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    code = run(["ladder", "run", *(str(CPU / f"{n}.toml") for n in CPU_RUNGS[:2]), "--root", str(tmp_path / "r"),
                "--sbatch"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "no sbatch on PATH" in err and "\n" not in err


@pytest.mark.parametrize("case", ["equal_compute", "not_a_rung", "one_rung", "same_name"])
def test_ladder_run_refuses_bad_rungs_before_training(capsys, tmp_path, case):
    root = tmp_path / "ladder"
    d32, d48 = CPU / "d32.toml", CPU / "d48.toml"
    rungs, extra = [d32, d48], []
    if case == "equal_compute":
        copy = tmp_path / "copy.toml"
        copy.write_text(f'extends = "{d32}"\nname = "copy"\n')
        rungs, message = [d32, copy], "rungs d32 and copy have equal compute"
    elif case == "not_a_rung":
        odd = tmp_path / "target.toml"
        odd.write_text(f'extends = "{CPU / "target.toml"}"\n[eval]\nsources = ["docs_val"]\n')
        extra, message = ["--target", str(odd)], "not a ladder rung of ladder-cpu-target: eval.sources"
    elif case == "one_rung":
        rungs, message = [d32], "needs at least 2 rung recipes"
    else:
        other = tmp_path / "x" / "d32.toml"
        other.parent.mkdir()
        other.write_text(f'extends = "{d48}"\n')
        rungs, message = [d32, other], "two rung recipes are named 'd32'"
    code = run(["ladder", "run", *map(str, rungs), "--root", str(root), *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "\n" not in err
    assert not root.exists()  # nothing trained, nothing written


def test_plot_draws_a_tracked_run_against_its_forecast_and_the_rungs_behind_it(capsys, tmp_path):
    from marinctl.forecast import read_forecast
    from marinctl.ladder import step_progress

    root = tmp_path / "ladder"
    for name in CPU_RUNGS:
        write_cpu_rung(root, name)
    target = CPU / "target.toml"
    law = tmp_path / "forecast.json"
    fit_json(
        capsys, *(str(root / n) for n in CPU_RUNGS), "--target", str(target), "--irreducible", "1", "--out", str(law)
    )
    forecast = read_forecast(law)
    recipe = load_recipe(target, [f"eval.forecast={law}"])
    run_dir = tmp_path / "target"
    run_dir.mkdir()
    (run_dir / "recipe.toml").write_text(recipe_to_toml(recipe))
    steps, records = recipe.train.steps, [{"kind": "eval", "step": 0, "macro_loss": 5.6}]
    for step in sorted({round(g * steps) for g in PROGRESS_GRID}):  # what the trainer writes, 1% worse
        f = forecast.at(step_progress(step, steps))
        records.append({"kind": "train", "step": step - 1, "loss": 4.0, "ce": 4.0})
        records.append(
            {"kind": "eval", "step": step, "macro_loss": 1.01 * f, "forecast": f, "forecast_delta": 0.01 * f}
        )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    code = run(["plot", str(run_dir), "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    plots = {Path(p).name for p in json.loads(captured.out)["plots"]}
    assert {"loss.png", "forecast.png", "ladder.png"} <= plots
    for name in ("forecast.png", "ladder.png"):
        assert (run_dir / name).read_bytes()[:4] == b"\x89PNG"
