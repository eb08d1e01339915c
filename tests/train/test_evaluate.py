"""Which dropless transport evaluation and inference pick (the numbers themselves: tests/stages/test_eval.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import marinctl.train.evaluate as evaluate
from marinctl.recipe import load_recipe

MICRO = Path(__file__).resolve().parents[1] / "micro.toml"  # top-2 of 8 experts


@pytest.mark.parametrize(
    ("experts", "top_k", "dense_bytes", "want"),
    [
        (8, 2, evaluate.DENSE_EVAL_BYTES, "ragged"),  # dense would do 4x the routed expert work
        (16, 4, evaluate.DENSE_EVAL_BYTES, "ragged"),  # the tiny recipe's
        (4, 2, evaluate.DENSE_EVAL_BYTES, "dense"),  # 2x: dense while it is small
        (4, 2, 1, "ragged"),  # ... and ragged once dense's intermediate would not fit
    ],
)
def test_eval_and_inference_use_ragged_where_dense_does_more_than_twice_the_routed_work(
    experts, top_k, dense_bytes, want, monkeypatch
):
    from marinctl.export import inference_recipe

    monkeypatch.setattr(evaluate, "DENSE_EVAL_BYTES", dense_bytes)
    recipe = load_recipe(MICRO, [f"moe.num_experts={experts}", f"moe.top_k={top_k}", "moe.ragged_buffer_factor=1.25"])
    assert evaluate.eval_transport(recipe, 1) == want
    assert inference_recipe(recipe, 64).moe.transport == want  # a short call too
    dropless = evaluate.dropless_recipe(recipe, 1).moe
    assert dropless.transport == want and dropless.ragged_buffer_factor is None  # ragged unbounded: no drops
