"""bench/profile_step.py's attribution of compiled ops to components (the benchmark itself prints; not timed here)."""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from marinctl.model.moe import SharedExperts

_spec = importlib.util.spec_from_file_location("profile_step", Path(__file__).parents[2] / "bench" / "profile_step.py")
profile_step = importlib.util.module_from_spec(_spec)
sys.modules["profile_step"] = profile_step  # its dataclasses resolve their module while it executes
_spec.loader.exec_module(profile_step)


def test_forward_and_backward_products_of_a_linear_go_to_the_component_that_called_it():
    """`layers.linear`'s forward product has `layers.py _linear_fwd` innermost; it belongs to the shared experts
    that called it, not to the model-wide fallback (which took it while the fallback was a rule of the walk)."""
    d, i, n = 16, 8, 2
    keys = jax.random.split(jax.random.key(0), 3)
    shared = SharedExperts(
        w_gate=jax.random.normal(keys[0], (n, d, i)),
        w_up=jax.random.normal(keys[1], (n, d, i)),
        w_down=jax.random.normal(keys[2], (n, i, d)),
    )

    def loss(module, m):
        return jnp.sum(module(m) ** 2)

    text = jax.jit(jax.grad(loss)).lower(shared, jnp.ones((32, d))).compile().as_text()
    instrs = profile_step.parse_hlo(text)
    dots = {name: instr for name, instr in instrs.items() if instr.opcode == "dot"}
    forward = [instr for instr in dots.values() if not instr.backward]
    assert forward and any(any(fn == "_linear_fwd" for _, fn, _ in instr.frames) for instr in forward)
    assert {profile_step.component_of(instr) for instr in dots.values()} == {"shared experts"}


def test_a_model_frame_no_rule_names_falls_back_to_other_model():
    source = Path(profile_step.REPO) / "marinctl" / "model" / "transformer.py"
    line = 1 + next(n for n, text in enumerate(source.read_text().splitlines()) if "UNROLL_MAX_LAYERS =" in text)
    frames = ((str(source), "Transformer.__call__", line),)
    assert profile_step.component_of(profile_step.Instr("fusion", frames, False)) == "other model (positions, scan)"
    assert profile_step.component_of(None) == profile_step.UNATTRIBUTED


def test_busy_union_counts_overlapping_events_once():
    assert profile_step.busy_union_ns([(0, 10), (5, 10), (20, 5), (21, 1)]) == 20
    assert profile_step.busy_union_ns([]) == 0
