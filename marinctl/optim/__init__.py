"""Hyperball optimizer: MuonH / AdamH / Adam groups (docs/recipe.md §5)."""

from marinctl.optim.build import build_optimizer, optimizer_state_shardings
from marinctl.optim.groups import group_of, group_sizes, hyperball_norms, param_group_labels
from marinctl.optim.hyperball import frobenius_norm, hyperball, initial_norms
from marinctl.optim.muon import NS_COEFFICIENTS, newton_schulz, scale_by_muon
from marinctl.optim.schedule import lr_schedule

__all__ = [
    "NS_COEFFICIENTS",
    "build_optimizer",
    "frobenius_norm",
    "group_of",
    "group_sizes",
    "hyperball",
    "hyperball_norms",
    "initial_norms",
    "lr_schedule",
    "newton_schulz",
    "optimizer_state_shardings",
    "param_group_labels",
    "scale_by_muon",
]
