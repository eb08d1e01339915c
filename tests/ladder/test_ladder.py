"""marinctl/ladder.py: per-progress power-law fits, early-stop extension, efficiency, reading run dirs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from marinctl.errors import UserError
from marinctl.ladder import (
    PROGRESS_GRID,
    PowerLaw,
    Rung,
    compute_efficiency,
    extension_line,
    fit_irreducible,
    fit_ladder,
    fit_power_law,
    read_rung,
    rung_on_grid,
    training_compute,
)
from marinctl.recipe import load_recipe, recipe_to_toml

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
E = 1.5
COMPUTES = (2.65e19, 1.73e20, 1.38e21, 7.78e21)  # the rungs' C (excl. lm_head) from recipes/ladder
GRID = np.asarray(PROGRESS_GRID)


def law_A(g):
    return 40.0 + 120.0 * g  # a different law at every progress, as the per-5% fit allows


def law_alpha(g):
    return 0.06 + 0.04 * g


def law_loss(g, compute):
    return E + law_A(g) * (g * compute) ** -law_alpha(g)


def synthetic_rung(name: str, compute: float, progress: np.ndarray) -> Rung:
    return Rung(name, compute, progress, np.asarray([law_loss(g, compute) if g > 0 else 11.0 for g in progress]))


def test_progress_grid_is_every_five_percent_to_the_end():
    assert len(PROGRESS_GRID) == 20 and PROGRESS_GRID[0] == 0.05 and PROGRESS_GRID[-1] == 1.0
    np.testing.assert_allclose(np.diff(PROGRESS_GRID), 0.05, atol=1e-12)


def test_fit_recovers_each_progress_law_and_forecasts_its_value_at_the_target():
    progress = np.concatenate([[0.0], GRID])
    rungs = [synthetic_rung(f"r{i}", c, progress) for i, c in enumerate(COMPUTES)]
    target = 2.611e24
    fit = fit_ladder(rungs, target, irreducible=E)
    assert len(fit.per_progress) == 20
    for f in fit.per_progress:
        g = f.progress
        assert f.law.A == pytest.approx(law_A(g), rel=1e-9)
        assert f.law.alpha == pytest.approx(law_alpha(g), rel=1e-9)
        assert f.target_compute == pytest.approx(g * target, rel=1e-12)
        assert f.forecast == pytest.approx(law_loss(g, target), rel=1e-10)
        assert f.residual_rms < 1e-10 and f.rungs == ("r0", "r1", "r2", "r3")
    assert fit.final.forecast == pytest.approx(E + law_A(1.0) * target ** -law_alpha(1.0), rel=1e-10)
    assert fit.extrapolated() == []


@pytest.mark.parametrize("E_true", [0.0, 0.7, 1.5])
def test_fitted_irreducible_loss_recovers_the_floor_of_an_exact_law(E_true):
    compute = np.asarray(COMPUTES)
    loss = E_true + 60.0 * compute**-0.09
    assert fit_irreducible(compute, loss) == pytest.approx(E_true, abs=2e-3)


def test_fitted_irreducible_loss_stays_at_zero_for_a_convex_log_log_curve_and_needs_three_budgets():
    compute = np.asarray(COMPUTES)
    loss = np.exp(3.0 - 0.05 * np.log(compute) - 0.002 * np.log(compute) ** 2)  # bends down: no floor in sight
    assert fit_irreducible(compute, loss) == 0.0
    with pytest.raises(UserError, match="three or more compute budgets"):
        fit_irreducible(compute[:2], loss[:2])


def test_fit_ladder_fits_E_once_from_the_final_losses_and_holds_it_for_every_progress():
    progress = np.concatenate([[0.0], GRID])
    rungs = [synthetic_rung(f"r{i}", c, progress) for i, c in enumerate(COMPUTES)]
    fit = fit_ladder(rungs, 2.611e24, irreducible=None)
    assert fit.irreducible_fitted and fit.irreducible == pytest.approx(E, abs=2e-3)
    assert {f.law.E for f in fit.per_progress} == {fit.irreducible}
    assert fit.final.forecast == pytest.approx(law_loss(1.0, 2.611e24), rel=1e-3)
    assert not fit_ladder(rungs, 2.611e24, irreducible=E).irreducible_fitted


def test_power_law_fit_is_the_least_squares_line_in_log_space():
    rng = np.random.default_rng(0)
    compute = np.asarray(COMPUTES)
    loss = E + 90.0 * compute**-0.09 * np.exp(rng.normal(0, 0.02, len(compute)))
    law, rms = fit_power_law(compute, loss, E)
    # Independent oracle: the normal equations of y = b0 + b1 x, solved by hand.
    x, y = np.log(compute), np.log(loss - E)
    b1 = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    b0 = y.mean() - b1 * x.mean()
    assert law.alpha == pytest.approx(-b1, rel=1e-9) and law.A == pytest.approx(np.exp(b0), rel=1e-8)
    assert rms == pytest.approx(np.sqrt(np.mean((y - b0 - b1 * x) ** 2)), rel=1e-8) and rms > 0


def test_loss_between_evals_is_linearly_interpolated():
    rung = Rung("r", 1e20, np.asarray([0.0, 0.12, 0.31, 0.77, 1.0]), np.asarray([9.0, 4.0, 3.5, 3.0, 2.9]))
    on_grid = rung_on_grid(rung)
    # g = 0.25 lies between 0.12 (4.0) and 0.31 (3.5); g = 0.80 between 0.77 (3.0) and 1.0 (2.9).
    assert on_grid.loss[4] == pytest.approx(4.0 + (0.25 - 0.12) / (0.31 - 0.12) * (3.5 - 4.0), rel=1e-12)
    assert on_grid.loss[15] == pytest.approx(3.0 + (0.80 - 0.77) / (1.0 - 0.77) * (2.9 - 3.0), rel=1e-12)
    assert on_grid.loss[-1] == 2.9 and not on_grid.extrapolated.any()


def test_a_rung_with_no_eval_before_g_has_no_loss_there():
    rung = Rung("r", 1e20, np.asarray([0.2, 1.0]), np.asarray([3.0, 2.5]))
    on_grid = rung_on_grid(rung)
    assert np.isnan(on_grid.loss[:3]).all() and np.isfinite(on_grid.loss[3:]).all()


def test_early_stopped_rung_continues_the_line_of_its_sixty_to_eighty_percent_window():
    # Curved before the window, linear inside it with a small wiggle, stopped at 81% (the post's d1536).
    progress = np.round(np.arange(0, 82) / 100, 2)
    wiggle = 0.003 * np.sin(40 * progress)
    loss = np.where(progress < 0.6, 2.2 + 0.4 * (0.6 - progress) ** 2, 2.2) - 0.3 * (progress - 0.6) + wiggle
    rung = Rung("d1536", 1e21, progress, loss)
    inside = (progress >= 0.6) & (progress <= 0.8)
    x, y = progress[inside], loss[inside]
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    intercept = y.mean() - slope * x.mean()
    assert extension_line(rung) == pytest.approx((intercept, slope), rel=1e-9)
    on_grid = rung_on_grid(rung)
    after = GRID > 0.81
    assert list(GRID[on_grid.extrapolated]) == [0.85, 0.9, 0.95, 1.0]
    np.testing.assert_allclose(on_grid.loss[after], intercept + slope * GRID[after], rtol=1e-12)
    np.testing.assert_allclose(on_grid.loss[~after], np.interp(GRID[~after], progress, loss), rtol=1e-12)


def test_exactly_linear_window_extends_to_the_linear_continuation():
    progress = np.asarray([0.0, 0.2, 0.4, 0.6, 0.65, 0.7, 0.75, 0.8, 0.81])
    rung = Rung("r", 1e21, progress, 3.0 - 0.5 * progress)
    on_grid = rung_on_grid(rung)
    np.testing.assert_allclose(on_grid.loss[-4:], 3.0 - 0.5 * GRID[-4:], rtol=1e-12)


def test_rung_stopped_inside_the_window_or_with_extension_off_is_not_extended():
    progress = np.asarray([0.0, 0.5, 0.6, 0.7])
    short = rung_on_grid(Rung("r", 1e21, progress, 3.0 - 0.5 * progress))
    assert not short.extrapolated.any() and np.isnan(short.loss[GRID > 0.7]).all()
    assert "before the end of the 60%–80% window" in short.note
    progress = np.asarray([0.0, 0.6, 0.7, 0.8, 0.85])
    off = rung_on_grid(Rung("r", 1e21, progress, 3.0 - 0.5 * progress), extend=False)
    assert not off.extrapolated.any() and np.isnan(off.loss[-3:]).all() and "extension off" in off.note


def test_fit_reports_extrapolated_points_and_drops_unextendable_rungs_from_late_fits():
    full = np.concatenate([[0.0], GRID])
    early = full[full <= 0.81]
    rungs = [
        synthetic_rung("a", COMPUTES[0], full),
        synthetic_rung("b", COMPUTES[1], early),
        synthetic_rung("c", COMPUTES[2], full),
    ]
    fit = fit_ladder(rungs, 1e24)
    [ext] = fit.extrapolated()
    assert ext["rung"] == "b" and ext["progress"] == [0.85, 0.9, 0.95, 1.0] and ext["last_progress"] == 0.8
    assert fit.final.rungs == ("a", "b", "c")
    no_ext = fit_ladder(rungs, 1e24, extend=False)
    assert no_ext.extrapolated() == [] and no_ext.final.rungs == ("a", "c")
    # Two rungs on the exact law still recover it at g = 1.
    assert no_ext.final.law.alpha == pytest.approx(law_alpha(1.0), rel=1e-9)


def test_a_progress_with_fewer_than_two_rungs_has_no_fit():
    rungs = [
        synthetic_rung("a", COMPUTES[0], np.concatenate([[0.0], GRID])),
        synthetic_rung("b", COMPUTES[1], GRID[GRID >= 0.3]),
    ]
    fit = fit_ladder(rungs, 1e24)
    assert all(f.law is None and f.forecast is None for f in fit.per_progress[:5])
    assert all(f.law is not None for f in fit.per_progress[5:])


def test_fit_rejects_too_few_rungs_equal_compute_and_losses_below_the_irreducible_loss():
    progress = np.asarray([0.0, 1.0])
    with pytest.raises(UserError, match="at least 2 rungs"):
        fit_ladder([Rung("a", 1e20, progress, np.asarray([5.0, 3.0]))], 1e24)
    with pytest.raises(UserError, match="two or more different compute"):
        fit_ladder(
            [Rung("a", 1e20, progress, np.asarray([5.0, 3.0])), Rung("b", 1e20, progress, np.asarray([5.0, 2.9]))], 1e24
        )
    with pytest.raises(UserError, match=r"rung b: loss 1\.4000 at g=0\.05 is not above"):
        fit_ladder(
            [Rung("a", 1e20, progress, np.asarray([5.0, 3.0])), Rung("b", 1e21, progress, np.asarray([1.4, 1.4]))], 1e24
        )


def test_efficiency_matches_a_hand_computation_on_the_posts_baseline_law():
    # The post's baseline L(C) = 1.6 + 88.90·C^−0.0941; a variant reaching 2.75 at C = 1e20.
    # By hand (40-digit decimal): (88.90 / 1.15)^(1/0.0941) = 1.163935778e20; the baseline gives 2.766546 at 1e20.
    law = PowerLaw(A=88.90, alpha=0.0941, E=1.6)
    assert law(1e20) == pytest.approx(2.766545710, rel=1e-9)
    c_need, efficiency = compute_efficiency(law, 2.75, 1e20)
    assert c_need == pytest.approx(1.163935778e20, rel=1e-9)
    assert efficiency == pytest.approx(1.163935778, rel=1e-9)
    assert law(c_need) == pytest.approx(2.75, rel=1e-12)


@pytest.mark.parametrize(
    ("baseline", "variant", "published"),
    [(3.0289, 3.0091, 1.16), (2.7810, 2.7674, 1.13), (3.0289, 3.0009, 1.23)],
    ids=["d768-8of384", "d1024-8of384", "d768-16of768"],
)
def test_efficiency_reproduces_the_posts_expert_granularity_table(baseline, variant, published):
    # Step-matched runs: the baseline law passes through the 4-of-192 run's loss at the shared compute.
    compute = 5e19
    law = PowerLaw(A=(baseline - 1.6) * compute**0.0941, alpha=0.0941, E=1.6)
    _, efficiency = compute_efficiency(law, variant, compute)
    assert round(efficiency, 2) == published


def test_efficiency_of_a_loss_at_or_below_the_irreducible_loss_is_a_user_error():
    with pytest.raises(UserError, match="above the irreducible loss"):
        compute_efficiency(PowerLaw(88.9, 0.0941, 1.6), 1.6, 1e20)


def test_target_compute_of_the_hero_is_2_61e24_excluding_the_lm_head(hero_recipe):
    assert training_compute(hero_recipe) == pytest.approx(2.61e24, rel=5e-3)


def test_ladder_rungs_span_the_posts_5e19_to_9e21_flops_with_the_lm_head():
    from marinctl.counting import flops_per_token

    with_head = {}
    for name in ("d768", "d2048"):
        r = load_recipe(RECIPES / "ladder" / f"{name}.toml")
        with_head[name] = flops_per_token(r).train(r.total_tokens)
        assert training_compute(r) < with_head[name]
    assert 5e19 <= with_head["d768"] < 6e19 and 9e21 <= with_head["d2048"] < 1e22


def _run_dir(tmp_path, records, steps=200, name="d768"):
    run_dir = tmp_path / name
    run_dir.mkdir()
    recipe = load_recipe(RECIPES / "ladder" / f"{name}.toml", [f"train.steps={steps}"])
    (run_dir / "recipe.toml").write_text(recipe_to_toml(recipe))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir, recipe


def test_read_rung_takes_progress_from_steps_and_compute_from_the_saved_recipe(tmp_path):
    records = [
        {"kind": "train", "step": 1, "loss": 7.0},
        {"kind": "eval", "step": 0, "macro_loss": 11.0},
        {"kind": "eval", "step": 2, "macro_loss": 3.5},
        {"kind": "eval", "step": 1, "macro_loss": 4.0},
        {"kind": "eval", "step": 2, "macro_loss": 3.4},  # re-evaluated after a resume: last wins
        {"kind": "eval", "step": 4},
    ]  # no eval sources: no macro loss
    run_dir, recipe = _run_dir(tmp_path, records, steps=4)
    rung = read_rung(run_dir)
    assert rung.name == "d768" and rung.compute == training_compute(recipe)
    np.testing.assert_array_equal(rung.progress, [0.0, 0.25, 0.5])
    np.testing.assert_array_equal(rung.loss, [11.0, 4.0, 3.4])


def test_read_rung_ends_the_curve_at_the_first_non_finite_loss(tmp_path):
    records = [
        {"kind": "eval", "step": s, "macro_loss": v} for s, v in ((0, 9.0), (1, 4.0), (2, float("nan")), (3, 3.0))
    ]
    rung = read_rung(_run_dir(tmp_path, records, steps=4)[0])
    np.testing.assert_array_equal(rung.progress, [0.0, 0.25])
    assert "non-finite from step 2" in rung.note


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("nodir", "not a directory"),
        ("norecipe", "no recipe.toml"),
        ("nometrics", "no metrics.jsonl"),
        ("noevals", "no eval records"),
        ("badstep", "bad step"),
    ],
)
def test_read_rung_names_what_is_wrong_with_a_run_directory(tmp_path, setup, message):
    run_dir, _ = _run_dir(tmp_path, [{"kind": "eval", "step": 0, "macro_loss": 5.0}])
    if setup == "nodir":
        run_dir = tmp_path / "missing"
    elif setup == "norecipe":
        (run_dir / "recipe.toml").unlink()
    elif setup == "nometrics":
        (run_dir / "metrics.jsonl").unlink()
    elif setup == "noevals":
        (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 0, "loss": 5.0}) + "\n")
    else:
        (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": "x", "macro_loss": 5.0}) + "\n")
    with pytest.raises(UserError, match=message):
        read_rung(run_dir)
