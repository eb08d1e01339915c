"""The learning-rate heuristic and schedule of docs/recipe.md §5: one function the planner and the trainer share.

The Adam LR law is the public run's fit over (total tokens, width, tokens per batch); MuonH rides at
13/3 of it, and AdamH on the lm_head uses the MuonH LR. Any value can be pinned in `[optimizer]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from marinctl.recipe import Recipe


@dataclass(frozen=True)
class HyperParams:
    adam_lr: float
    muonh_lr: float
    adamh_lr: float
    beta1: float
    beta2: float
    epsilon: float
    warmup_steps: int
    steps: int
    final_lr_fraction: float


def heuristic_adam_lr(total_tokens: float, hidden: int, tokens_per_batch: float) -> float:
    """adam_lr = min(0.05, 0.087571 * Tt^-0.3461 * D^-0.3448 * sqrt(B)) (the run's fit)."""
    return min(0.05, 0.087571 * total_tokens**-0.3461 * hidden**-0.3448 * math.sqrt(tokens_per_batch))


def hyperparams(recipe: Recipe) -> HyperParams:
    o, s = recipe.optimizer, recipe.schedule
    B, Tt, D = recipe.tokens_per_step, recipe.total_tokens, recipe.model.hidden
    adam = o.adam_lr if o.adam_lr is not None else heuristic_adam_lr(Tt, D, B)
    muonh = o.muonh_lr if o.muonh_lr is not None else min(0.05, 13 / 3 * adam)
    steps = recipe.train.steps
    warmup = s.warmup_steps if s.warmup_steps is not None else math.ceil(s.warmup_fraction * steps)
    return HyperParams(
        adam_lr=adam,
        muonh_lr=muonh,
        adamh_lr=o.adamh_lr if o.adamh_lr is not None else muonh,
        beta1=o.beta1 if o.beta1 is not None else 0.9062,
        beta2=o.beta2 if o.beta2 is not None else min(0.9999, max(0.95, 0.999 ** (B / 131072))),
        epsilon=o.epsilon if o.epsilon is not None else 9.676e-18 * math.sqrt(Tt / B),
        warmup_steps=min(warmup, steps),
        steps=steps,
        final_lr_fraction=s.final_lr_fraction,
    )


def lr_multiplier(step: int, warmup_steps: int, steps: int, final_fraction: float) -> float:
    """Plain-Python schedule (multiplier of peak): the reference the optax schedule is tested against.

    Warmup from 0 over `warmup_steps`, then linear decay reaching `final_fraction` at the last step
    (`steps - 1`). Step 0 therefore applies LR 0 when there is a warmup, as docs/recipe.md §5 says ("from 0").
    """
    if warmup_steps > 0 and step < warmup_steps:
        return step / warmup_steps
    last = max(steps - 1, warmup_steps)
    if last == warmup_steps:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / (last - warmup_steps))
    return 1.0 - (1.0 - final_fraction) * progress
