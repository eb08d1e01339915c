"""The LR schedule of docs/recipe.md §5 as an optax schedule: warmup from 0, then linear decay to 5% of peak.

It must equal `marinctl.hparams.lr_multiplier` (the plain-Python reference the planner uses) at
every step; tests compare the two at step 0, the end of warmup, mid-decay and the last step.
"""

from __future__ import annotations

import optax

from marinctl.hparams import HyperParams


def lr_schedule(hp: HyperParams, peak: float) -> optax.Schedule:
    """`peak * lr_multiplier(count)`; `count` is the number of updates already applied (0 at step 0)."""
    warmup, last = hp.warmup_steps, max(hp.steps - 1, hp.warmup_steps)
    decay = (
        optax.linear_schedule(peak, peak * hp.final_lr_fraction, last - warmup)
        if last > warmup
        else optax.constant_schedule(peak)  # no room to decay: lr_multiplier stays at 1
    )
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def weight_decay_schedule(hp: HyperParams, strength: float) -> optax.Schedule:
    """Decoupled weight decay `strength` annealed linearly to 0 at the last step (docs/recipe.md §5)."""
    return optax.linear_schedule(strength, 0.0, max(hp.steps - 1, 1))
