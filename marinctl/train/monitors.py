"""Health monitors: the failures the public run found by eye (docs/recipe.md §10), caught by the trainer instead.

Each check is a pure function over host-side numbers (norms the step already computes); `HealthMonitor`
keeps the little history they need (initial hyperball norms, the previous step's norms, a window of
embedding gradient norms, dead-expert streaks) and round-trips it through the checkpoint metadata, so a
resumed run warns exactly as the uninterrupted one would.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from marinctl.recipe import LogConfig

# Window of the running median of embedding gradient norms: long enough to ignore a single noisy step,
# short enough to follow the warmup's drift.
EMBED_WINDOW = 50
# Steps the spike check waits for before trusting the median.
EMBED_MIN_HISTORY = 5
# Consecutive steps an expert's gradient must stay near zero to be reported dead: an expert can miss
# one batch by chance, it cannot miss twenty in a row while alive.
DEAD_EXPERT_PATIENCE = 20


class NonFiniteAbort(RuntimeError):
    """Too many consecutive non-finite steps: the run cannot recover by skipping (exit 1)."""


def nonfinite_streak(streak: int, finite: bool, limit: int, step: int) -> int:
    """Consecutive non-finite steps after this one; raises `NonFiniteAbort` when it reaches `limit`."""
    streak = 0 if finite else streak + 1
    if streak >= limit:
        raise NonFiniteAbort(
            f"step {step}: {streak} consecutive non-finite losses/gradients (train.max_nonfinite_steps="
            f"{limit}); the last checkpoint is intact — lower the LR or inspect the data at these steps"
        )
    return streak


def hyperball_drift(norms: Mapping[str, Any], initial: Mapping[str, Any], tol: float) -> list[tuple[str, float]]:
    """Hyperball matrices whose norm left its initial value by more than `tol` (relative): the optimizer
    must hold them on the sphere, so any drift is a bug (the public run's lm_head lost 86% of its norm)."""
    out = []
    for name, init in initial.items():
        now, init = np.asarray(norms[name], np.float64), np.asarray(init, np.float64)
        rel = float(np.max(np.abs(now - init) / np.maximum(init, 1e-30)))
        if rel > tol:
            out.append((name, rel))
    return out


def norm_jumps(norms: Mapping[str, Any], previous: Mapping[str, Any], tol: float) -> list[tuple[str, float]]:
    """Any matrix whose norm changed by more than `tol` (relative) in one step (the lm_head collapse:
    150.7 -> 21.4 in one update while the total norm moved 0.24%)."""
    out = []
    for name, prev in previous.items():
        if name not in norms:
            continue
        now, prev = np.asarray(norms[name], np.float64), np.asarray(prev, np.float64)
        rel = float(np.max(np.abs(now - prev) / np.maximum(prev, 1e-30)))
        if rel > tol:
            out.append((name, rel))
    return out


def embed_spike(history: list[float], value: float, factor: float) -> float | None:
    """value / running median when it exceeds `factor` (why the embedding stayed on plain Adam)."""
    if len(history) < EMBED_MIN_HISTORY:
        return None
    median = statistics.median(history)
    if median > 0 and value > factor * median:
        return value / median
    return None


def near_zero_experts(expert_grad_norms: Any, tol: float) -> np.ndarray:
    """Bool [L, E]: an expert's gradient norm below `tol` x the median of its layer's experts."""
    g = np.asarray(expert_grad_norms, np.float64)
    median = np.median(g, axis=-1, keepdims=True)
    return g < tol * median


@dataclass
class HealthMonitor:
    """History for the checks above; `observe` returns this step's warnings (the loop shows and records them)."""

    config: LogConfig
    max_nonfinite: int
    hyperball: tuple[str, ...]  # names of the norms that must stay at their initial value
    # Names whose one-step jumps are watched: randomly initialized matrices. Zero-initialized leaves
    # (the attention gate) grow from 0, where any relative change is meaningless.
    matrices: tuple[str, ...] | None = None
    initial_norms: dict[str, list] = field(default_factory=dict)
    previous_norms: dict[str, list] = field(default_factory=dict)
    embed_history: list[float] = field(default_factory=list)
    dead_streak: list[list[int]] = field(default_factory=list)
    nonfinite: int = 0
    warned_dead: list[list[int]] = field(default_factory=list)

    def start(self, norms: Mapping[str, Any]) -> None:
        """Record the initial norms of a fresh run (the hyperball radius of every matrix)."""
        self.initial_norms = {k: _tolist(norms[k]) for k in self.hyperball}
        self.previous_norms = {k: _tolist(v) for k, v in norms.items()}

    def observe(
        self,
        step: int,
        *,
        finite: bool,
        norms: Mapping[str, Any] | None = None,
        embed_grad_norm: float | None = None,
        expert_grad_norms: Any = None,
    ) -> list[str]:
        self.nonfinite = nonfinite_streak(self.nonfinite, finite, self.max_nonfinite, step)
        if not finite:
            return [f"step {step}: non-finite loss or gradient — update skipped ({self.nonfinite} in a row)"]
        cfg, warnings = self.config, []
        if norms is not None:
            for name, rel in hyperball_drift(norms, self.initial_norms, cfg.norm_drift_tol):
                warnings.append(f"step {step}: hyperball matrix {name} is {rel:.2%} off its initial norm")
            watched = (
                self.previous_norms
                if self.matrices is None
                else {k: v for k, v in self.previous_norms.items() if k in self.matrices}
            )
            for name, rel in norm_jumps(norms, watched, cfg.norm_jump_tol):
                warnings.append(f"step {step}: norm of {name} changed by {rel:.0%} in one step")
            self.previous_norms = {k: _tolist(v) for k, v in norms.items()}
        if embed_grad_norm is not None and math.isfinite(embed_grad_norm):
            ratio = embed_spike(self.embed_history, embed_grad_norm, cfg.embed_spike_factor)
            if ratio is not None:
                warnings.append(f"step {step}: embedding gradient norm spiked to {ratio:.1f}x its running median")
            self.embed_history = [*self.embed_history, embed_grad_norm][-EMBED_WINDOW:]
        if expert_grad_norms is not None:
            warnings += self._dead_experts(step, near_zero_experts(expert_grad_norms, cfg.dead_expert_tol))
        return warnings

    def _dead_experts(self, step: int, near_zero: np.ndarray) -> list[str]:
        streak = np.asarray(self.dead_streak, np.int64) if self.dead_streak else np.zeros(near_zero.shape, np.int64)
        warned = np.asarray(self.warned_dead, bool) if self.warned_dead else np.zeros(near_zero.shape, bool)
        streak = np.where(near_zero, streak + 1, 0)
        newly = (streak >= DEAD_EXPERT_PATIENCE) & ~warned
        warned = (warned | newly) & (streak > 0)  # an expert that recovers may be reported again
        self.dead_streak, self.warned_dead = streak.tolist(), warned.tolist()
        return [
            f"step {step}: expert {e} of layer {layer} has had a near-zero gradient for {DEAD_EXPERT_PATIENCE} steps"
            for layer, e in zip(*np.nonzero(newly), strict=True)
        ]

    def state_dict(self) -> dict[str, Any]:
        return {
            "initial_norms": self.initial_norms,
            "previous_norms": self.previous_norms,
            "embed_history": self.embed_history,
            "dead_streak": self.dead_streak,
            "warned_dead": self.warned_dead,
            "nonfinite": self.nonfinite,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.initial_norms = dict(state["initial_norms"])
        self.previous_norms = dict(state["previous_norms"])
        self.embed_history = list(state["embed_history"])
        self.dead_streak = list(state["dead_streak"])
        self.warned_dead = list(state["warned_dead"])
        self.nonfinite = int(state["nonfinite"])


def _tolist(value: Any) -> Any:
    return np.asarray(value, np.float64).tolist()
