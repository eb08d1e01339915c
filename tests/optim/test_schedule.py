"""The optax LR schedule (marinctl/optim/schedule.py) against `marinctl.hparams.lr_multiplier`, and the heuristic."""

import dataclasses

import pytest

from marinctl.hparams import hyperparams, lr_multiplier
from marinctl.optim.schedule import lr_schedule, weight_decay_schedule


def check_points(hp) -> dict[str, int]:
    last = hp.steps - 1
    return {"start": 0, "end of warmup": hp.warmup_steps, "mid-decay": (hp.warmup_steps + last) // 2, "last": last}


@pytest.mark.parametrize("recipe_name", ["tiny_recipe", "hero_recipe"])
def test_schedule_equals_lr_multiplier_at_start_end_of_warmup_mid_decay_and_last_step(recipe_name, request):
    hp = hyperparams(request.getfixturevalue(recipe_name))
    schedule = lr_schedule(hp, hp.muonh_lr)
    for where, step in check_points(hp).items():
        expected = hp.muonh_lr * lr_multiplier(step, hp.warmup_steps, hp.steps, hp.final_lr_fraction)
        assert float(schedule(step)) == pytest.approx(expected, rel=1e-6, abs=1e-12), where
    assert float(schedule(0)) == 0.0  # warmup starts from 0
    assert float(schedule(hp.steps - 1)) == pytest.approx(0.05 * hp.muonh_lr, rel=1e-6)  # 5% of peak


def test_hero_warmup_is_one_percent_of_its_steps(hero_recipe):
    assert hyperparams(hero_recipe).warmup_steps == 3903


@pytest.mark.parametrize(("warmup", "steps"), [(0, 10), (10, 10), (3, 4)])
def test_schedule_handles_no_warmup_and_no_decay_room(tiny_recipe, warmup, steps):
    hp = dataclasses.replace(hyperparams(tiny_recipe), warmup_steps=warmup, steps=steps)
    schedule = lr_schedule(hp, 2.0)
    for step in range(steps + 2):
        assert float(schedule(step)) == pytest.approx(2.0 * lr_multiplier(step, warmup, steps, 0.05), rel=1e-6)


def test_heuristic_reproduces_the_hero_learning_rates(hero_recipe):
    hp = hyperparams(hero_recipe)
    assert hp.adam_lr == pytest.approx(7.593e-4, rel=5e-4)
    assert hp.muonh_lr == pytest.approx(3.290e-3, rel=5e-4)
    assert hp.adamh_lr == hp.muonh_lr  # AdamH on the lm_head rides at the MuonH LR


def test_weight_decay_anneals_linearly_to_zero_at_the_last_step(tiny_recipe):
    hp = hyperparams(tiny_recipe)
    decay = weight_decay_schedule(hp, 0.3)
    last = hp.steps - 1
    assert float(decay(0)) == pytest.approx(0.3)
    assert float(decay(last // 2)) == pytest.approx(0.3 * (1 - (last // 2) / last), rel=1e-6)
    assert float(decay(last)) == 0.0
