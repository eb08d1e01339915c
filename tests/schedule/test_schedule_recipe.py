"""marinctl/schedule.py and the loader under a schedule, without compiling anything: segments, the batch as a
pure function of (seed, step, schedule), constant tokens per step, and every bad recipe input."""

import dataclasses
import math

import numpy as np
import pytest

from marinctl.errors import RecipeError
from marinctl.recipe import load_recipe
from marinctl.schedule import at_context, eval_recipe, qk_auto, segments

from .conftest import EXTEND_AT, RAGGED_AT, STEPS


def same(a, b):
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_segments_carry_the_effective_recipe(recipes):
    recipe = load_recipe(recipes["scheduled"])
    segs = segments(recipe)
    assert [(s.start, s.stop) for s in segs] == [(0, RAGGED_AT), (RAGGED_AT, EXTEND_AT), (EXTEND_AT, STEPS)]
    shapes = [(s.recipe.train.seq_len, s.recipe.train.batch_size, s.recipe.moe.transport) for s in segs]
    assert shapes == [(32, 16, "fixed"), (32, 16, "ragged"), (64, 8, "ragged")]
    assert {s.recipe.tokens_per_step for s in segs} == {512}
    assert segs[2].recipe.attention.qk_mult == pytest.approx(1.3 * (1 + 0.1 * math.log(2)))
    assert segs[1].labels == ("fixed → ragged EP",) and segs[2].labels == ("32 → 64 context",)
    # everything else (optimizer, LR schedule, model shape) is the base recipe's
    for s in segs:
        assert (s.recipe.model, s.recipe.optimizer, s.recipe.schedule) == (recipe.model, recipe.optimizer,
                                                                           recipe.schedule)  # fmt: skip


def test_qk_auto_is_the_published_rule(hero_recipe):
    """docs/recipe.md §8: 1.3 at 4k, 1.480 at 16k, 1.660 at 65k."""
    assert [round(qk_auto(hero_recipe, s), 3) for s in (4096, 16384, 65536)] == [1.3, 1.480, 1.660]


def test_the_hero_schedule_keeps_46M_tokens_per_step(hero_recipe):
    segs = segments(hero_recipe)
    assert {s.recipe.tokens_per_step for s in segs} == {46_137_344}
    assert [s.recipe.train.seq_len for s in segs][-1] == 65536
    assert segs[-1].recipe.attention.qk_mult == pytest.approx(1.66, abs=5e-4)
    assert any(s.recipe.moe.transport == "ragged" for s in segs)


def test_batches_are_a_pure_function_of_seed_step_and_schedule(recipes):
    from marinctl.data.loader import Loader

    recipe = load_recipe(recipes["scheduled"])
    loader = Loader(recipe)
    for step in range(STEPS):
        batch = loader.batch(step)
        rows, S = batch["tokens"].shape
        assert rows * S == 512 and S == (64 if step >= EXTEND_AT else 32)
        assert np.array_equal(batch["tokens"][:, 1:], batch["targets"][:, :-1])
    fresh = Loader(recipe)  # a resumed run: no history
    for step in (EXTEND_AT + 3, EXTEND_AT, 2):
        assert same(fresh.batch(step), loader.batch(step))
    hosts = [loader.host_batch(EXTEND_AT + 1, i, 2) for i in range(2)]
    assert same(loader.batch(EXTEND_AT + 1), {k: np.concatenate([h[k] for h in hosts]) for k in hosts[0]})


def test_a_change_that_keeps_the_shape_leaves_every_batch_as_it_was(recipes):
    """The transport switch is invisible to the data; before the extension the batches are the base run's."""
    from marinctl.data.loader import Loader

    base = Loader(load_recipe(recipes["base"]))
    switched = Loader(load_recipe(recipes["base"], ['schedule.changes=[{at_step=3, moe={transport="ragged"}}]']))
    scheduled = Loader(load_recipe(recipes["scheduled"]))
    assert all(same(base.batch(s), switched.batch(s)) for s in range(STEPS))
    assert all(same(base.batch(s), scheduled.batch(s)) for s in range(EXTEND_AT))


def test_after_an_extension_each_source_continues_where_its_tokens_left_off(recipes):
    """The first long rows of a source start the window ⌈tokens drawn / S⌉ of its epoch: no restart at window 0."""
    from marinctl.data.loader import Loader

    loader = Loader(load_recipe(recipes["scheduled"]))
    given, offset = loader._offsets[1]
    for name in loader.phases[0].sources:
        assert given[name] > 0 and offset[name] == -(-given[name] * 32 // 64)
    assert loader.rows_before(EXTEND_AT) == 16 * EXTEND_AT and loader.rows_before(EXTEND_AT + 2) == 16 * 10 + 8 * 2


def test_a_data_mix_change_is_a_mixture_phase(recipes):
    from marinctl.data.loader import Loader

    changed = load_recipe(recipes["base"], ["schedule.changes=[{at_step=7, data={weights={docs=1.0, code=0.0}}}]"])
    phases = load_recipe(recipes["base"])
    weights = [dict(p.weights) for p in phases.data.phases]
    explicit = dataclasses.replace(
        phases.data,
        phases=(
            dataclasses.replace(phases.data.phases[0]),
            dataclasses.replace(phases.data.phases[0], start_step=7, weights={"docs": 1.0, "code": 0.0}),
            dataclasses.replace(phases.data.phases[1], start_fraction=None, start_step=round(0.8 * STEPS)),
        ),
    )
    assert weights[0] == {"docs": 0.5, "code": 0.5}
    a, b = Loader(changed), Loader(phases.replace(data=explicit))
    assert all(same(a.batch(s), b.batch(s)) for s in range(STEPS))
    assert set(a.sources_of(8)) == {"docs"}


def test_eval_recipe_is_the_context_of_the_last_trained_step(recipes):
    recipe = load_recipe(recipes["scheduled"])
    assert eval_recipe(recipe, EXTEND_AT).train.seq_len == 32  # checkpoint 10: steps 0-9 trained at 32
    after = eval_recipe(recipe, STEPS)
    assert after.train.seq_len == 64 and after.attention.qk_mult > recipe.attention.qk_mult
    first = eval_recipe(recipe, STEPS, 32)
    assert first == at_context(after, 32) and first.attention.qk_mult == after.attention.qk_mult


def test_an_extension_holds_eval_tokens_per_batch(recipes, tiny_recipe):
    """Explicit eval rows are re-derived as the train batch is (the demo: 16 x 256 -> 4 x 1024), so an eval
    after the extension scores the same targets at its context and at the first one."""
    from marinctl.data.loader import Loader

    last = segments(tiny_recipe)[-1].recipe
    assert (last.train.seq_len, last.eval.batch_size) == (1024, 4)
    assert at_context(last, 256).eval.batch_size == 16
    recipe = load_recipe(recipes["scheduled"])
    assert [s.recipe.eval.batch_size for s in segments(recipe)] == [16, 16, 8]
    loader, scored = Loader(recipe), {}
    for seq_len, rows in ((32, 16), (64, 8)):
        batches = list(loader.eval_batches("docs_val", 2, rows, seq_len))
        scored[seq_len] = np.concatenate([b["targets"][b["loss_mask"] > 0] for b in batches])
    assert len(scored[32]) > 0.9 * 2 * 16 * 32 and np.array_equal(scored[32], scored[64])
    with pytest.raises(RecipeError, match=r"eval.batch_size: 1 x 32 = 32 tokens per eval batch do not split into "
                                           r"rows of schedule.changes\[1\].train.seq_len=64"):  # fmt: skip
        load_recipe(recipes["scheduled"], ["eval.batch_size=1"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("{at_step=3, train={seq_len=48}}", "schedule.changes[0].train.seq_len: 48 does not divide the run's 512"),
        ("{at_step=3, train={seq_len=512}}", "schedule.changes[0].train.seq_len: 512 leaves 1 sequences per step"),
        ("{at_step=3, train={seq_len=8}}", "schedule.changes[0].train.seq_len: 8 is shorter than attention.window"),
        ('{at_step=3, moe={transport="teleport"}}', "schedule.changes[0].moe.transport: must be one of"),
        ('{at_step=16, moe={transport="ragged"}}', "schedule.changes[0].at_step: step 16 is past the run's last step"),
        ('{at_fraction=0.5, at_step=2, moe={transport="ragged"}}', "set exactly one of at_step and at_fraction"),
        ("{at_step=3}", "schedule.changes[0]: changes nothing"),
        ('{at_step=3, attention={qk_mult="big"}}', "schedule.changes[0].attention.qk_mult: expected a number or"),
        ("{at_step=3, data={weights={nope=1.0}}}", "schedule.changes[0].data.weights.nope: no such source"),
    ],
)
def test_bad_changes_name_the_field(recipes, change, message):
    with pytest.raises(RecipeError, match=None) as err:
        load_recipe(recipes["base"], [f"schedule.changes=[{change}]"])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_two_changes_at_one_step_that_conflict_are_refused(recipes):
    changes = '[{at_step=4, moe={transport="ragged"}}, {at_step=4, moe={transport="pooled"}}]'
    with pytest.raises(RecipeError, match=r"schedule.changes\[1\].moe.transport: conflicts with schedule.changes\[0\]"):
        load_recipe(recipes["base"], [f"schedule.changes={changes}"])
    agreeing = '[{at_step=4, moe={transport="ragged"}}, {at_step=4, moe={transport="ragged", capacity_factor=2.0}}]'
    merged = segments(load_recipe(recipes["base"], [f"schedule.changes={agreeing}"]))
    assert merged[1].recipe.moe.transport == "ragged" and merged[1].recipe.moe.capacity_factor == 2.0


def test_set_clears_the_schedule(recipes, tiny_recipe):
    assert len(tiny_recipe.schedule.changes) >= 2
    assert load_recipe(recipes["scheduled"], ["schedule.changes=[]"]).schedule.changes == ()
