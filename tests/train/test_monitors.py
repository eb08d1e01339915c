"""Health monitors (docs/recipe.md §10) as pure functions over norms, and their history across a resume."""

import json

import numpy as np
import pytest

from marinctl.recipe import LogConfig
from marinctl.train.monitors import (
    DEAD_EXPERT_PATIENCE,
    EMBED_MIN_HISTORY,
    HealthMonitor,
    NonFiniteAbort,
    embed_spike,
    hyperball_drift,
    near_zero_experts,
    nonfinite_streak,
    norm_jumps,
)


def test_nonfinite_streak_resets_on_a_finite_step_and_aborts_at_the_limit():
    streak = 0
    for finite in (False, False, True, False):
        streak = nonfinite_streak(streak, finite, limit=3, step=0)
    assert streak == 1
    streak = nonfinite_streak(streak, False, limit=3, step=7)
    with pytest.raises(NonFiniteAbort, match="step 8: 3 consecutive"):
        nonfinite_streak(streak, False, limit=3, step=8)


def test_hyperball_drift_flags_only_matrices_beyond_tolerance_per_layer():
    initial = {"w_q": [10.0, 20.0], "lm_head": 150.7}
    norms = {"w_q": [10.05, 20.0], "lm_head": 21.4}
    assert hyperball_drift(norms, initial, tol=0.01) == [("lm_head", pytest.approx(1 - 21.4 / 150.7))]
    flagged = dict(hyperball_drift(norms, initial, tol=0.001))
    assert set(flagged) == {"w_q", "lm_head"} and flagged["w_q"] == pytest.approx(0.005)


def test_norm_jump_catches_the_lm_head_collapse_while_total_norm_barely_moves():
    prev = {"lm_head": 150.7, "embed": 1000.0}
    now = {"lm_head": 21.4, "embed": 1000.0}
    assert [n for n, _ in norm_jumps(now, prev, tol=0.5)] == ["lm_head"]
    total_prev = np.sqrt(sum(v**2 for v in prev.values()))
    total_now = np.sqrt(sum(v**2 for v in now.values()))
    assert abs(total_now / total_prev - 1) < 0.02  # invisible in the global norm, visible per matrix


def test_embed_spike_compares_to_the_running_median_after_a_warm_history():
    history = [1.0, 1.2, 0.9, 1.1, 1.0]
    assert embed_spike(history[: EMBED_MIN_HISTORY - 1], 100.0, 10.0) is None
    assert embed_spike(history, 9.0, 10.0) is None
    assert embed_spike(history, 20.0, 10.0) == pytest.approx(20.0)


def test_near_zero_experts_is_relative_to_the_layer_median():
    g = np.array([[1.0, 1.1, 0.9, 1e-5], [100.0, 90.0, 0.05, 110.0]])
    np.testing.assert_array_equal(near_zero_experts(g, tol=1e-3), [[0, 0, 0, 1], [0, 0, 1, 0]])


def _monitor():
    return HealthMonitor(LogConfig(), max_nonfinite=3, hyperball=("lm_head",))


def test_monitor_reports_a_dead_expert_once_after_its_patience():
    mon = _monitor()
    mon.start({"lm_head": 1.0})
    g = np.array([[1.0, 1.0, 1.0, 0.0]])
    reports = [mon.observe(s, finite=True, expert_grad_norms=g) for s in range(2 * DEAD_EXPERT_PATIENCE)]
    fired = [s for s, r in enumerate(reports) if r]
    assert fired == [DEAD_EXPERT_PATIENCE - 1]
    assert "expert 3 of layer 0" in reports[DEAD_EXPERT_PATIENCE - 1][0]


def test_monitor_history_round_trips_through_json_and_resumes_identically():
    a, b = _monitor(), _monitor()
    a.start({"lm_head": 150.0})
    for s in range(8):
        a.observe(s, finite=True, norms={"lm_head": 150.0}, embed_grad_norm=1.0 + 0.01 * s)
    a.observe(8, finite=False)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for mon in (a, b):
        out = mon.observe(9, finite=True, norms={"lm_head": 20.0}, embed_grad_norm=50.0)
        assert len(out) == 3  # drift, jump and spike
    assert a.state_dict() == b.state_dict()


def test_zero_initialized_leaves_are_not_watched_for_one_step_jumps():
    mon = HealthMonitor(LogConfig(), max_nonfinite=3, hyperball=(), matrices=("lm_head",))
    mon.start({"lm_head": 1.0, "gate": 0.0})
    assert mon.observe(0, finite=True, norms={"lm_head": 1.0, "gate": 0.1}) == []
    assert mon.observe(1, finite=True, norms={"lm_head": 0.1, "gate": 0.5})[0].endswith("changed by 90% in one step")
