"""`[runtime]`: environment and XLA flags that must be in place before JAX initializes its backend.

The hero needed GPU settings (cuda_async allocator, ragged all-to-all without the NCCL barrier, the
latency-hiding scheduler, a long NCCL termination timeout); they live in the recipe, not in a launch
script, so every host of every run gets the same ones.
"""

from __future__ import annotations

import logging
import os
import sys

from marinctl.recipe import RuntimeConfig

log = logging.getLogger(__name__)


def apply_runtime(runtime: RuntimeConfig) -> None:
    backend_started = "jax" in sys.modules and _backend_initialized()
    if backend_started and (runtime.env or runtime.xla_flags):
        log.warning("JAX already started: [runtime] settings apply to new processes only")
    for key, value in runtime.env.items():
        os.environ.setdefault(key, value)  # an explicit environment wins over the recipe
    if runtime.xla_flags:
        present = os.environ.get("XLA_FLAGS", "").split()
        names = {flag.split("=", 1)[0] for flag in present}
        extra = [f for f in runtime.xla_flags if f.split("=", 1)[0] not in names]
        os.environ["XLA_FLAGS"] = " ".join([*present, *extra]).strip()


def _backend_initialized() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge._backends)
    except Exception:  # private API moved: assume started, which only costs a warning
        return True
