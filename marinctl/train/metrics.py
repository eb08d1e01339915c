"""Metrics: `RUN_DIR/metrics.jsonl` (the contract), optional TensorBoard / W&B sinks, the peak behind MFU.

Every record is one JSON object with `"kind": "train"` or `"kind": "eval"`. Names are a contract
(STYLE.md: dashboards and forecasts read them): train records carry `step, loss, ce, z_loss, lr,
grad_norm, tokens_per_s, tflops_per_device, mfu, drop_frac, routing_entropy` (plus per-layer lists and,
every `log.norms_every` steps, `param_norm/<path>` and `grad_norm/<group>`); eval records carry `step,
macro_loss, loss/<source>, bpb/<source>`. Only process 0 writes.

FLOP convention (stated in every run's header): docs/recipe.md §7 — forward FLOPs per token with full-square
attention and the lm_head included, times 3 for training (`marinctl.counting.flops_per_token`). On a CPU
the peak is a matmul measured at start-up on the same devices; on a GPU, the dense bf16 datasheet peak.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from marinctl.errors import UserError
from marinctl.recipe import LogConfig

log = logging.getLogger(__name__)

FLOP_CONVENTION = "docs/recipe.md §7: 3 x forward FLOPs/token (full-square attention, lm_head included)"

# Dense bf16 peak FLOP/s per device, by substring of `device_kind` (datasheets, without sparsity).
GPU_PEAK_BF16 = {"GB200": 2.5e15, "B200": 2.25e15, "H200": 989e12, "H100": 989e12, "A100": 312e12}


class MetricsLog:
    """Append-only JSON lines. `resume(step)` first drops what a killed run logged past its checkpoint,
    so a resumed run's file reads exactly like an uninterrupted one."""

    def __init__(self, path: Path, *, enabled: bool, sinks: list[Any] | None = None):
        self.path, self.enabled, self.sinks = path, enabled, sinks or []
        self._file = None

    def resume(self, step: int) -> None:
        """Keep train records of updates before `step` and eval records before `step` (re-run at resume)."""
        if not self.enabled or not self.path.exists():
            return
        kept = [r for r in read_metrics(self.path) if r.get("step", 0) < step]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)  # atomic: a crash here leaves the old file or the new one

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", buffering=1)  # line-buffered: readable while running
        self._file.write(json.dumps(_finite_or_null(record), default=_json_default, allow_nan=False) + "\n")
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        for sink in self.sinks:
            sink.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl; a torn last line (a killed writer) is ignored."""
    out = []
    with path.open() as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def _finite_or_null(value: Any) -> Any:
    """NaN and infinities become null: strict JSON has no such numbers (a skipped step's loss is NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    if hasattr(value, "tolist"):
        return _finite_or_null(value.tolist())
    return value


def _json_default(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _scalars(record: dict[str, Any]) -> Iterator[tuple[str, float]]:
    for key, value in record.items():
        if key in ("kind", "step") or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            yield f"{record['kind']}/{key}", float(value)


class TensorBoardSink:
    """TensorBoard event files in RUN_DIR/tensorboard (tensorboardX: no TensorFlow needed)."""

    def __init__(self, run_dir: Path):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise UserError("log.tensorboard = true needs tensorboardX: pip install 'marinctl[tensorboard]'") from None
        self._writer = SummaryWriter(str(run_dir / "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        for key, value in _scalars(record):
            self._writer.add_scalar(key, value, global_step=record["step"])

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Weights & Biases, offline unless WANDB_MODE says otherwise (no network needed); the run id is
    derived from the run dir so a resumed run appends to the same W&B run."""

    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise UserError("log.wandb = true needs wandb: pip install 'marinctl[wandb]'") from None
        run_id = "".join(c if c.isalnum() else "-" for c in run_dir.absolute().as_posix()).strip("-")[-64:]
        self._run = wandb.init(
            project=project,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
        )

    def write(self, record: dict[str, Any]) -> None:
        self._run.log(dict(_scalars(record)), step=record["step"])

    def close(self) -> None:
        self._run.finish()


def make_sinks(cfg: LogConfig, run_dir: Path, recipe_dict: dict[str, Any]) -> list[Any]:
    sinks: list[Any] = []
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir))
    if cfg.wandb:
        sinks.append(WandbSink(run_dir, cfg.wandb_project, recipe_dict))
    return sinks


# --------------------------------------------------------------------------------------------------
# Throughput and MFU.


# Per-compile XLA:CPU options the peak matmul is also timed under: YNNPACK's dot, which marinctl's CPU default
# flags turn off for the step (marinctl/runtime.py) but which runs one large product ~10% faster. The MFU
# peak is the faster of the two, so turning YNNPACK off never raises MFU by lowering its denominator.
CPU_PEAK_VARIANTS: tuple[dict[str, str], ...] = (
    {},
    {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_DOT"},
)


def measure_matmul_peak(devices: list[Any], n: int = 1024, repeats: int = 5, seconds: float = 0.3) -> float:
    """FLOP/s per device of an n x n f32 matmul running on every device at once: the best call of at least
    `repeats` calls and `seconds` of calls per compiled variant.

    All devices run together because simulated CPU devices share the host's cores: the aggregate is the
    host's throughput, and dividing by the device count gives the per-device share MFU is measured against.
    On CPU the product is compiled under each of `CPU_PEAK_VARIANTS` and the fastest counts. The time floor
    is there because a best of five ~10 ms calls read 20-25% under the machine's peak on these shared 2-core
    hosts (bench/README.md, stop 27), which inflated MFU by as much.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(np.asarray(devices), ("d",))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    x = jax.device_put(jnp.ones((len(devices), n, n), jnp.float32) / n, sharding)
    lowered = jax.jit(lambda a: jnp.einsum("bij,bjk->bik", a, a), out_shardings=sharding).lower(x)
    best = math.inf
    for options in CPU_PEAK_VARIANTS if devices[0].platform == "cpu" else ({},):
        try:
            matmul = lowered.compile(compiler_options=options or None)
        except Exception:  # an XLA without the option: the default compile is still timed
            if not options:
                raise
            continue
        matmul(x).block_until_ready()
        until, calls = time.perf_counter() + seconds, 0
        while calls < repeats or time.perf_counter() < until:
            start = time.perf_counter()
            matmul(x).block_until_ready()
            best, calls = min(best, time.perf_counter() - start), calls + 1
    return 2 * n**3 / best


def device_peak_flops(devices: list[Any]) -> tuple[float, str]:
    """(peak FLOP/s per device, how it was obtained) for the MFU denominator."""
    kind = getattr(devices[0], "device_kind", "")
    if devices[0].platform == "gpu":
        for name, peak in GPU_PEAK_BF16.items():
            if name.lower() in kind.lower():
                return peak, f"{name} dense bf16 datasheet peak"
    peak = measure_matmul_peak(devices)
    return peak, f"measured {devices[0].platform} f32 matmul ({len(devices)} devices at once)"


def throughput(tokens: int, seconds: float, flops_per_token: float, n_devices: int, peak: float) -> dict[str, float]:
    """tokens/s, model TFLOP/s per device and MFU for `tokens` trained in `seconds` (docs/recipe.md §7 convention)."""
    tokens_per_s = tokens / max(seconds, 1e-9)
    per_device = 3.0 * flops_per_token * tokens_per_s / n_devices
    return {"tokens_per_s": tokens_per_s, "tflops_per_device": per_device / 1e12, "mfu": per_device / peak}
