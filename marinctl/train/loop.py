"""The run, top to bottom: devices → mesh → state (fresh or restored) → steps → checkpoints → eval → plots.

    for step in start .. steps-1:
        batch  = loader.host_batch(step)            each host reads only its rows
        state, metrics = train_step(state, batch)   jitted, sharded, state donated
        log the previous step's metrics             one step behind, so the host never stalls the devices
        checkpoint every N (async) · evaluate every M (dropless) · stop cleanly on SIGTERM/SIGUSR1

Exact resume: the state holds everything that evolves (model, optimizer, QB bias, step = data position,
RNG, skipped count), the batch is a pure function of (seed, step, schedule), the monitors' history rides in the
checkpoint metadata, and metrics.jsonl is cut back to the checkpoint. So a run killed after a checkpoint
and re-run ends bitwise equal to an uninterrupted one on the same devices.
"""

from __future__ import annotations

import errno
import functools
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from marinctl.errors import EXIT_OK, EXIT_PREEMPTED, UserError
from marinctl.recipe import Recipe, load_recipe, recipe_to_dict, recipe_to_toml
from marinctl.runtime import describe_host_heap, host_pages_released
from marinctl.stage import console
from marinctl.train.distributed import DistributedConfig
from marinctl.train.precompile import Precompiler

log = logging.getLogger(__name__)

HostBatch = dict[str, np.ndarray]


@dataclass(frozen=True)
class RunOptions:
    run_dir: Path
    quiet: bool = False
    distributed: DistributedConfig | None = None
    devices: list[Any] | None = None  # default: every device of every process
    # Alters a host batch before it reaches the devices. Fault-injection seam for tests (a NaN loss mask
    # makes a non-finite step); None in every real run.
    batch_hook: Callable[[int, HostBatch], HostBatch] | None = None


@dataclass
class RunSummary:
    """The `--json` contract: steps, final_loss, eval_macro_loss, run_dir, exit_reason, and more."""

    steps: int
    final_loss: float | None
    eval_macro_loss: float | None
    run_dir: str
    exit_reason: str  # "done" | "preempted" | "diverged" | "disk-full"
    initial_eval_macro_loss: float | None = None
    eval: dict[str, float] = field(default_factory=dict)
    resumed_from: int | None = None
    checkpoint_step: int | None = None
    nonfinite_skipped: int = 0
    tokens_per_s: float | None = None
    mfu: float | None = None
    peak_tflops: float | None = None  # the MFU denominator: the better of the start and end measurements
    wall_s: float = 0.0
    message: str = ""

    @property
    def exit_code(self) -> int:
        return {"done": EXIT_OK, "preempted": EXIT_PREEMPTED}.get(self.exit_reason, 1)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Preemption:
    """SIGTERM / SIGUSR1 (what SLURM sends before a requeue or time limit) ask the loop to stop after the
    current step; the loop checkpoints and exits 3. Across processes the earliest request wins."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.flag = threading.Event()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> Preemption:
        if _EARLY_STOP.is_set():  # SIGTERM/SIGUSR1 arrived during start-up (compile, restore): stop at once
            self.flag.set()
        if threading.current_thread() is threading.main_thread():  # handlers only install there
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        log.warning("received %s: finishing the step, checkpointing, exiting with code 3", signal.Signals(signum).name)
        self.flag.set()

    def requested(self, process_count: int) -> bool:
        if process_count == 1:
            return self.flag.is_set()
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.flag.is_set()))
        return bool(np.any(flags))

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


_EARLY_STOP = threading.Event()


def _early_stop(signum: int, frame: Any) -> None:
    """Until the loop's own handlers are in place (start-up can take minutes), a preemption signal is kept
    for the loop rather than killing the process by the default action: SLURM's `--signal=USR1@N` often
    arrives while a requeued job is still compiling or restoring."""
    name = signal.Signals(signum).name
    log.warning("received %s during start-up: will checkpoint after the first step and exit 3", name)
    _EARLY_STOP.set()


def configure_jax() -> None:
    """A persistent compilation cache, so re-runs and resumes skip XLA compilation: JAX_COMPILATION_CACHE_DIR
    when set, else an already configured one, else ~/.cache/marinctl/xla."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    wanted = (
        os.environ.get("JAX_COMPILATION_CACHE_DIR")
        or jax.config.jax_compilation_cache_dir
        or str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "marinctl" / "xla")
    )
    if wanted != jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", wanted)
        compilation_cache.reset_cache()  # the cache is set up once per process; make it see the new dir
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)


def eval_due(step: int, last_step: int, every: int, grid: frozenset[int] = frozenset()) -> bool:
    """At the start (step 0), every `eval.every` steps, at the ladder grid's steps, and at the end."""
    return step == 0 or step == last_step or (every > 0 and step % every == 0) or step in grid


def prepare_run_dir(run_dir: Path, recipe: Recipe, is_main: bool) -> None:
    """Create the run dir and save the resolved recipe; a changed recipe in an existing run is named."""
    if not is_main:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "recipe.toml"
    if path.is_file():
        try:
            before = recipe_to_dict(load_recipe(path))
        except UserError:
            before = {}
        changed = _changed_keys(before, recipe_to_dict(recipe))
        if changed:
            log.warning("%s: recipe changed since the last run of this directory: %s", run_dir, ", ".join(changed[:8]))
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text(recipe_to_toml(recipe))
    os.replace(tmp, path)


def _at(key: str, seq_len: int) -> str:
    """An eval key at another context: `macro_loss` -> `macro_loss@256`, `loss/docs` -> `loss@256/docs`."""
    head, sep, tail = key.partition("/")
    return f"{head}@{seq_len}{sep}{tail}"


def _changed_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, dict) and isinstance(vb, dict):
            out += _changed_keys(va, vb, f"{prefix}{key}.")
        elif va != vb and key not in ("name", "description"):
            out.append(f"{prefix}{key}")
    return out


def run(recipe: Recipe, options: RunOptions) -> RunSummary:
    """Train `recipe` into `options.run_dir` (resuming from its newest valid checkpoint)."""
    from contextlib import nullcontext

    from marinctl.runlock import RunLock
    from marinctl.train import distributed

    # One trainer per run dir, taken before anything else so a second one is refused at once; process 0
    # holds it for a multi-process run (the run dir is shared).
    main_process = options.distributed is None or options.distributed.process_id == 0
    previous = {}
    if threading.current_thread() is threading.main_thread():
        _EARLY_STOP.clear()
        previous = {sig: signal.signal(sig, _early_stop) for sig in Preemption.SIGNALS}
    with RunLock(options.run_dir) if main_process else nullcontext(), _restore_handlers(previous):
        distributed.initialize(options.distributed, str(options.run_dir))  # before anything else touches the devices
        configure_jax()
        import jax

        from marinctl.train.launch import check_batch_divides, check_fits

        wall_start = time.perf_counter()
        devices = list(options.devices or jax.devices())
        process_index, process_count = jax.process_index(), jax.process_count()
        # Fail fast, before tokenizing or allocating anything.
        from marinctl.schedule import segments, with_recorded

        given, recipe = recipe, with_recorded(recipe, options.run_dir)  # + switch-ep / extend-context changes
        sizes = check_fits(recipe, devices)
        for segment in segments(recipe):  # every shape the schedule will train (docs/recipe.md §8)
            check_batch_divides(segment.recipe, len(devices), process_count, first_seq_len=recipe.train.seq_len)
            check_fits(segment.recipe, devices)  # a longer context needs more activation memory
        job = _Run(recipe, options, devices, sizes, process_index, process_count, wall_start)
        job.saved_recipe = given  # RUN_DIR/recipe.toml keeps the recipe as given; recorded changes stay apart
        return job.execute()


@contextmanager
def _restore_handlers(previous: dict) -> Iterator[None]:
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Run:
    """One invocation of `run`; a class only to keep the loop's shared objects in one place."""

    def __init__(self, recipe, options, devices, sizes, process_index, process_count, wall_start):
        self.recipe, self.options, self.devices, self.sizes = recipe, options, devices, sizes
        self.process_index, self.process_count = process_index, process_count
        self.is_main = process_index == 0
        self.wall_start = wall_start
        self.out = console()
        self.show = self.is_main and not options.quiet
        self.saved_recipe = recipe

    def execute(self) -> RunSummary:
        import jax

        from marinctl.counting import flops_per_token
        from marinctl.data.builtin import ensure_builtin_corpus
        from marinctl.data.loader import Loader
        from marinctl.data.store import manifest_hash
        from marinctl.forecast import load_run_forecast
        from marinctl.hparams import hyperparams
        from marinctl.params import param_table
        from marinctl.routing.mesh import batch_sharding, make_mesh
        from marinctl.schedule import segment_at, segments
        from marinctl.train.checkpoint import CheckpointDiskFull, Checkpoints, unflatten_like
        from marinctl.train.evaluate import compile_eval_step
        from marinctl.train.metrics import MetricsLog, device_peak_flops, make_sinks
        from marinctl.train.monitors import HealthMonitor
        from marinctl.train.state import init_state
        from marinctl.train.step import compile_param_norms

        recipe, run_dir = self.recipe, self.options.run_dir
        self.forecast = load_run_forecast(recipe)  # a bad forecast file fails before the run dir is touched
        prepare_run_dir(run_dir, self.saved_recipe, self.is_main)
        self._corpus(ensure_builtin_corpus)
        self.loader = Loader(recipe)

        self.mesh = make_mesh(recipe.parallel, self.devices)
        self.batch_sharding = batch_sharding(self.mesh)
        optimizer, shardings, abstract = self._layout(recipe)

        ckpt_dir = Path(recipe.checkpoint.dir) if recipe.checkpoint.dir else run_dir / "checkpoints"
        self.checkpoints = Checkpoints(ckpt_dir, recipe.checkpoint)
        self.metrics = None
        try:
            table = param_table(recipe)
            self.monitor = HealthMonitor(
                recipe.log,
                recipe.train.max_nonfinite_steps,
                hyperball=tuple(p for p, s in table.items() if s.group in ("muonh", "adamh")),
                matrices=tuple(p for p, s in table.items() if s.init == "normal"),
            )
            with jax.set_mesh(self.mesh):
                restored = self.checkpoints.restore_latest(abstract)
                self._data_hashes = {name: manifest_hash(path) for name, path in self.loader.paths.items()}
                if restored is not None:
                    self._check_data_unchanged(restored)
                    from marinctl.schedule import check_schedule_history

                    check_schedule_history(recipe, restored.step, restored.meta, ckpt_dir)
                    state = unflatten_like(abstract, restored.state)
                    self.monitor.load_state_dict(restored.meta["monitors"])
                    start = restored.step
                else:
                    state, start = None, 0
                t0 = time.perf_counter()
                self.segments = segments(recipe)
                self._compiled: dict[tuple, Any] = {}
                self._eval_steps: dict[tuple, Any] = {}
                self._shardings = shardings
                first = segment_at(self.segments, start)
                ahead = recipe.runtime.precompile
                # Start-up runs three compiles: the state's initializer (~1.6 s in the tiny demo),
                # the first train step and the base eval step. One core compiles the train step while the
                # other initializes and compiles the eval step (bench/README.md, stops 30–32).
                build = functools.partial(self._build_step, first.recipe)
                self.precompiler = Precompiler(self.mesh, [(("train", first.shape_key), build)] if ahead else [])
                if state is None:
                    state = jax.jit(lambda: init_state(recipe, optimizer), out_shardings=shardings)()
                    self.monitor.start(jax.device_get(compile_param_norms(recipe, shardings)(state)))
                self.eval_step = compile_eval_step(recipe, shardings.model, self.batch_sharding)
                if ahead and recipe.eval.sources:
                    self.eval_step.compile(abstract.model, abstract.router_bias)
                state = self._enter(first, state)
                self.precompiler.close()
                compile_s = time.perf_counter() - t0

            self.hp = hyperparams(recipe)
            self.flops = flops_per_token(recipe)
            local = [d for d in self.devices if d.process_index == self.process_index]
            self._local_devices = local
            self.peak, peak_source = device_peak_flops(local)
            # The schedule's later steps compile on a background thread while this one trains: after this
            # segment's compile, so the first step is not kept waiting, and after the peak measurement, which
            # a compile beside it would halve (MFU's denominator; precompile.py).
            if recipe.runtime.precompile:
                self.precompiler = Precompiler(self.mesh, self._schedule_compiles(start))
            self.metrics = MetricsLog(
                run_dir / "metrics.jsonl",
                enabled=self.is_main,
                sinks=make_sinks(recipe.log, run_dir, recipe_to_dict(recipe)) if self.is_main else [],
            )
            self.metrics.resume(start)
            if self.show:
                self._header(start, restored, compile_s, peak_source)

            summary = RunSummary(
                steps=start,
                final_loss=None,
                eval_macro_loss=None,
                run_dir=str(run_dir),
                exit_reason="done",
                resumed_from=start if restored else None,
                checkpoint_step=restored.step if restored else None,
            )
            state = self._loop(state, start, summary)
        finally:
            if hasattr(self, "precompiler"):
                self.precompiler.close()  # the compile in flight finishes before the process exits
            disk_full = None
            try:
                self.checkpoints.wait()
            except CheckpointDiskFull as err:  # the last save, written in the background, found the disk full
                disk_full = err
            self.checkpoints.close()
            if self.metrics is not None:
                self.metrics.close()
        if disk_full is not None:
            summary.exit_reason, summary.message = "disk-full", str(disk_full)
        if summary.exit_reason == "done" and self.is_main:
            self._finish(summary)
        summary.wall_s = time.perf_counter() - self.wall_start
        return summary

    def _header(self, start: int, restored, compile_s: float, peak_source: str) -> None:
        """What runs where, and the FLOP convention behind MFU (the issue asks for it in the header)."""
        from marinctl.counting import count_params
        from marinctl.train.display import header_table
        from marinctl.train.evaluate import eval_transport
        from marinctl.train.metrics import FLOP_CONVENTION

        recipe, hp, counts = self.recipe, self.hp, count_params(self.recipe)
        mesh = " x ".join(f"{k}={v}" for k, v in self.sizes.items())
        where = f"{len(self.devices)} x {self.devices[0].device_kind} over {self.process_count} process(es)"
        rows = [
            ("recipe", f"{recipe.name} ({recipe.source})"),
            ("run dir", str(self.options.run_dir)),
            ("devices", f"{where}; mesh {mesh}"),
            ("parameters", f"{counts.total:,} total, {counts.active:,} active"),
            ("batch", f"{recipe.train.batch_size} x {recipe.train.seq_len} = {recipe.tokens_per_step:,} "
                      f"tokens/step, {recipe.train.steps} steps, grad_accum {recipe.train.grad_accum}"),
            ("optimizer", f"Adam {hp.adam_lr:.3g}, MuonH {hp.muonh_lr:.3g}, AdamH {hp.adamh_lr:.3g}; "
                          f"warmup {hp.warmup_steps}"),
            ("MoE", f"transport {recipe.moe.transport} (cf {recipe.moe.capacity_factor:g}), eval dropless via "
                    f"{eval_transport(recipe, len(self.devices))}, balancing {recipe.moe.balancing}"),
            ("FLOPs", f"{self.flops.per_token:.4g}/token forward; MFU convention {FLOP_CONVENTION}"),
            ("peak", f"{self.peak / 1e12:.3f} TFLOP/s per device ({peak_source})"),
            ("host heap", describe_host_heap()),
            ("schedule", "; ".join(f"{', '.join(s.labels)} @ {s.start}" for s in self.segments if s.labels) or "-"),
            ("start", f"resumed from step {start}" if restored else "fresh"),
            ("compile", f"{compile_s:.1f}s"),
        ]  # fmt: skip
        self.out.print(header_table(rows, "marinctl train"))
        if restored and restored.skipped:
            for reason in restored.reasons:
                self.out.print(f"[yellow]{reason}")

    def _corpus(self, ensure: Callable) -> None:
        """Build the built-in corpus once: process 0 first, then the others find it (shared or local)."""
        if self.is_main:
            if self.recipe.data.builtin and self.show:
                self.out.print(f"checking the built-in corpus under {self.recipe.data.root} …")
            ensure(self.recipe)
        if self.process_count > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("marinctl-corpus")
            if not self.is_main:
                ensure(self.recipe)

    # ----------------------------------------------------------------------------------------------

    def _loop(self, state, start: int, summary: RunSummary):
        import jax

        from marinctl.ladder import eval_grid_steps
        from marinctl.schedule import segment_at
        from marinctl.train.checkpoint import CheckpointDiskFull, save_due
        from marinctl.train.display import LiveDisplay
        from marinctl.train.monitors import NonFiniteAbort
        from marinctl.train.step import device_batch

        recipe, steps = self.recipe, self.recipe.train.steps
        display = LiveDisplay(self.out, steps, start, enabled=self.show)
        self._display = display  # the eval's forecast delta joins the live line
        hook = self.options.batch_hook
        self._last_done = time.perf_counter()
        self._throughput: list[dict[str, float]] = []
        try:
            with jax.set_mesh(self.mesh), Preemption() as preemption:
                grid = eval_grid_steps(recipe)
                if start < steps and eval_due(start, steps, recipe.eval.every, grid):
                    self._evaluate(state, start, summary)
                batches = self.loader.iterate(
                    start, steps, process_index=self.process_index, process_count=self.process_count
                )
                pending = None
                try:
                    for step in range(start, steps):
                        segment = segment_at(self.segments, step)
                        if step == segment.start and segment.changes:  # a transition: new shapes, new step
                            if pending is not None:
                                self._record(*pending, summary, display)
                                pending = None
                            state = self._transition(segment, state, display)
                        host = next(batches)
                        if hook is not None:
                            host = hook(step, host)
                        batch = device_batch(host, self.batch_sharding, segment.recipe.train.batch_size)
                        state, metrics = self.train_step(state, batch)
                        if pending is not None:  # the previous step's numbers, while this one runs
                            self._record(*pending, summary, display)
                        pending = (step, metrics)
                        done = step + 1
                        stop = preemption.requested(self.process_count)
                        save = save_due(done, steps, recipe.checkpoint.every) or stop
                        evaluate = eval_due(done, steps, recipe.eval.every, grid)
                        if save or evaluate:
                            self._record(*pending, summary, display)
                            pending = None
                        if save:
                            self._save(state, done, summary)
                        if evaluate:
                            self._evaluate(state, done, summary)
                        summary.steps = done
                        if stop and done < steps:
                            summary.exit_reason = "preempted"
                            summary.message = f"preempted: checkpoint at step {done}; re-run the command to continue"
                            break
                    if pending is not None:
                        self._record(*pending, summary, display)
                finally:
                    batches.close()
        except NonFiniteAbort as err:
            summary.exit_reason, summary.message = "diverged", str(err)
        except CheckpointDiskFull as err:  # exit 1 with one line; the checkpoints before it are intact
            summary.exit_reason, summary.message = "disk-full", str(err)
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            summary.exit_reason = "disk-full"
            where = err.filename or self.options.run_dir
            summary.message = f"{where}: disk full ({err.strerror}); free space and re-run the same command"
        finally:
            display.close()
        if start >= steps:  # already complete: report the final evaluation again
            with jax.set_mesh(self.mesh):
                self._evaluate(state, steps, summary)
            summary.steps = steps
        return state

    def _record(self, step: int, metrics: dict, summary: RunSummary, display) -> None:
        """Turn a step's device metrics into the metrics.jsonl record, the monitors' input and the display."""
        import jax

        from marinctl.hparams import lr_multiplier
        from marinctl.schedule import record_fields, segment_at
        from marinctl.train.metrics import throughput
        from marinctl.train.monitors import NonFiniteAbort

        m = jax.device_get(metrics)
        now = time.perf_counter()
        seconds, self._last_done = now - self._last_done, now
        finite = bool(m["finite"])
        skipped = int(m["nonfinite_skipped"])
        hp = self.hp
        applied = step - (skipped - (0 if finite else 1))  # the optimizer's count: skipped steps do not tick it
        mult = lr_multiplier(applied, hp.warmup_steps, hp.steps, hp.final_lr_fraction)
        segment = segment_at(self.segments, step)
        flops = self._flops_per_token(segment.recipe)  # attention FLOPs grow with the context
        speed = throughput(self.recipe.tokens_per_step, seconds, flops, len(self.devices), self.peak)
        record: dict[str, Any] = {
            "kind": "train",
            "step": step,
            "loss": float(m["loss"]),
            "ce": float(m["ce"]),
            "z_loss": float(m["z_loss"]),
            "lr": hp.adam_lr * mult,
            "lr_muonh": hp.muonh_lr * mult,
            "grad_norm": float(m["grad_norm"]),
            **speed,
            "drop_frac": float(m["drop_frac"]),
            "routing_entropy": float(m["routing_entropy"]),
            "finite": finite,
            "nonfinite_skipped": skipped,
            "loss_tokens": float(m["tokens"]),
            **record_fields(segment.recipe),
        }
        for key in ("drop_frac_per_layer", "sender_drop_frac_per_layer", "receiver_drop_frac_per_layer",
                    "routing_entropy_per_layer", "max_mean_load_per_layer", "router_z_per_layer"):  # fmt: skip
            record[key] = np.asarray(m[key]).tolist()
        for key, value in m.items():
            if key.startswith("grad_norm/") or key == "embed_grad_norm":
                record[key] = float(value)
        norms_every = self.recipe.log.norms_every
        if norms_every and (step % norms_every == 0 or step + 1 == self.recipe.train.steps):
            for path, value in m["param_norms"].items():
                record[f"param_norm/{path}"] = np.asarray(value).tolist()
            g = np.asarray(m.get("expert_grad_norm", np.zeros((0, 0))))
            if g.size:
                record["expert_grad_norm_min_over_median"] = float(
                    np.min(g / np.maximum(np.median(g, -1, keepdims=True), 1e-30))
                )
        try:
            warnings = self.monitor.observe(
                step,
                finite=finite,
                norms=m["param_norms"] if finite else None,
                embed_grad_norm=float(m["embed_grad_norm"]) if "embed_grad_norm" in m else None,
                expert_grad_norms=m.get("expert_grad_norm") if finite else None,
            )
        except NonFiniteAbort as err:  # after train.max_nonfinite_steps in a row: log the step, then stop
            self.metrics.write({**record, "warnings": [str(err)]})
            raise
        if warnings:
            record["warnings"] = warnings
            for text in warnings:
                display.message(f"[yellow]warning:[/yellow] {text}")
        if step % self.recipe.log.every == 0 or step + 1 == self.recipe.train.steps or warnings:
            self.metrics.write(record)
        summary.final_loss = record["loss"] if finite else summary.final_loss
        summary.nonfinite_skipped = skipped
        self._throughput.append(speed)
        display.update(record)

    def _check_data_unchanged(self, restored) -> None:
        """The batch is a pure function of (seed, step, token stores): a store rewritten since the checkpoint
        would silently feed different batches after the resume, so it is refused (exit 2)."""
        saved = restored.meta.get("data") or {}
        for name, digest in self._data_hashes.items():
            before = saved.get(name)
            if before is not None and digest != before:
                raise UserError(
                    f"{self.loader.paths[name]}: token store of source {name!r} changed since checkpoint "
                    f"{restored.step} was written (manifest sha256 {before[:12]}… now {str(digest)[:12]}…); "
                    "restore the original store, or train into a new --run-dir"
                )

    @host_pages_released()  # kept host pages are for the step loop only (runtime.py)
    def _save(self, state, step: int, summary: RunSummary) -> None:
        from marinctl.schedule import applied_before

        meta = {"monitors": self.monitor.state_dict(), "recipe": self.recipe.name, "data": self._data_hashes}
        meta["schedule"] = applied_before(self.recipe, step)  # what shaped its past (check_schedule_history)
        meta["devices"] = len(self.devices)  # switch-ep / extend-context check new shapes against the mesh
        self.checkpoints.save(step, state, meta)
        summary.checkpoint_step = step
        self._last_done = time.perf_counter()  # the copy off the devices is not training time

    # ----------------------------------------------------------------------------------------------
    # The schedule (marinctl/schedule.py): a new compiled step per shape, change records, eval per context.

    def _enter(self, segment, state):
        """Switch to a segment: its compiled train step (one per distinct shapes/transport/qk_mult), and the
        state re-assembled around the same arrays. The model pytree carries its config (transport, qk_mult)
        as static structure, so the leaves are moved by path into the segment's structure, as a checkpoint
        restore does: weights, optimizer state, QB bias, step and RNG pass through untouched. The segment's
        optimizer is numerically the base one (tokens per step, total tokens and width are unchanged)."""
        from marinctl.train.checkpoint import flatten_state, unflatten_like

        key = segment.shape_key
        if key not in self._compiled:
            self._compiled[key] = self.precompiler.get(("train", key), lambda: self._build_step(segment.recipe))
        self.train_step, self._shardings, abstract = self._compiled[key]
        return unflatten_like(abstract, flatten_state(state))

    def _layout(self, recipe: Recipe) -> tuple[Any, Any, Any]:
        """A segment's optimizer, state shardings and abstract (sharded) state."""
        from marinctl.train.state import abstract_state, make_optimizer, state_shardings, with_shardings

        optimizer = make_optimizer(recipe)
        shardings = state_shardings(recipe, optimizer, self.mesh)
        return optimizer, shardings, with_shardings(abstract_state(recipe, optimizer), shardings)

    def _build_step(self, recipe: Recipe) -> tuple[Callable, Any, Any]:
        """A segment's compiled train step, its state shardings and its abstract state."""
        from marinctl.train.step import compile_train_step

        optimizer, shardings, abstract = self._layout(recipe)
        return compile_train_step(recipe, optimizer, shardings, self.batch_sharding), shardings, abstract

    def _eval_contexts(self, current: Recipe) -> list[Recipe]:
        """The recipes a dropless eval runs after training `current`'s segment: its own context and, after
        an extension, the run's first one (see `_evaluate_across_context`)."""
        from marinctl.schedule import at_context

        first = self.recipe.train.seq_len
        return [current] if current.train.seq_len == first else [current, at_context(current, first)]

    def _build_eval_step(self, recipe: Recipe, segment_recipe: Recipe) -> Callable:
        """An eval step for `recipe` over the model structure of `segment_recipe`'s segment, compiled now
        (on the precompile thread where it was queued, `_schedule_compiles`)."""
        from marinctl.train.evaluate import compile_eval_step

        _, shardings, abstract = self._layout(segment_recipe)
        step = compile_eval_step(recipe, shardings.model, self.batch_sharding)
        return step.compile(abstract.model, abstract.router_bias)

    def _eval_key(self, recipe: Recipe) -> tuple:
        from marinctl.train.evaluate import eval_key

        return eval_key(recipe, self.mesh.size)

    def _schedule_compiles(self, start: int) -> list[tuple[tuple, Callable[[], Any]]]:
        """What the schedule will compile after `start`, in the order the run needs it: each later
        segment's train step, then the eval steps of its contexts (the base eval step excepted)."""
        from marinctl.schedule import segment_at

        jobs: list[tuple[tuple, Callable[[], Any]]] = []
        seen = {("train", segment_at(self.segments, start).shape_key), ("eval", self._eval_key(self.recipe))}

        def queue(key: tuple, build: Callable[[], Any]) -> None:
            if key not in seen:
                seen.add(key)
                jobs.append((key, build))

        for segment in self.segments:
            if segment.stop <= start:
                continue
            queue(("train", segment.shape_key), functools.partial(self._build_step, segment.recipe))
            for recipe in self._eval_contexts(segment.recipe):
                build = functools.partial(self._build_eval_step, recipe, segment.recipe)
                queue(("eval", self._eval_key(recipe)), build)
        return jobs

    @host_pages_released()  # kept host pages are for the step loop only (runtime.py)
    def _transition(self, segment, state, display):
        """At a change's first step: log a `"kind": "change"` record, switch to that segment's step."""
        from marinctl.schedule import record_fields, segment_at

        before = segment_at(self.segments, segment.start - 1).recipe if segment.start else self.recipe
        t0 = time.perf_counter()
        state = self._enter(segment, state)
        record = {
            "kind": "change",
            "step": segment.start,
            "name": "; ".join(segment.labels),
            "changes": list(segment.changes),
            **record_fields(segment.recipe),
            "before": record_fields(before),
            "compile_s": time.perf_counter() - t0,
        }
        self.metrics.write(record)
        display.message(f"step {segment.start}: {record['name']} (compiled in {record['compile_s']:.1f}s)")
        self._last_done = time.perf_counter()  # compiling is not the next step's training time
        return state

    def _flops_per_token(self, recipe: Recipe) -> float:
        from marinctl.counting import flops_per_token

        if recipe.train.seq_len == self.recipe.train.seq_len:
            return self.flops.per_token
        return flops_per_token(recipe).per_token

    def _evaluate_across_context(self, state, step: int, evaluate: Callable) -> dict[str, Any]:
        """Dropless eval at the context of the last trained step, labelled with its `seq_len`; after an
        extension also at the run's first context as `<key>@<S0>` (the hero re-evaluated every checkpoint
        at 4k), so both curves continue across the change."""
        from marinctl.schedule import segment_at

        current = segment_at(self.segments, max(step - 1, 0)).recipe
        first = self.recipe.train.seq_len
        out: dict[str, Any] = {"seq_len": current.train.seq_len}
        for recipe in self._eval_contexts(current):
            key = self._eval_key(recipe)
            if key not in self._eval_steps:  # over the model structure of the segment just trained
                same = key == self._eval_key(self.recipe)
                build = functools.partial(self._build_eval_step, recipe, current)
                self._eval_steps[key] = self.eval_step if same else self.precompiler.get(("eval", key), build)
            result = evaluate(
                self._eval_steps[key].at(recipe),  # one program for each qk_mult at a context
                state.model,
                state.router_bias,
                self.loader,
                recipe,
                self.batch_sharding,
                process_index=self.process_index,
                process_count=self.process_count,
            )
            if recipe is current:
                out.update(result)
            else:  # loss/docs_val -> loss@256/docs_val, macro_loss -> macro_loss@256
                out.update({_at(k, first): v for k, v in result.items()})
        return out

    @host_pages_released()  # kept host pages are for the step loop only (runtime.py)
    def _evaluate(self, state, step: int, summary: RunSummary) -> None:
        from marinctl.train.evaluate import evaluate

        if not self.recipe.eval.sources:
            return
        result = self._evaluate_across_context(state, step, evaluate)
        record = {"kind": "eval", "step": step, **result}
        note = self._track_forecast(step, record)
        self.metrics.write(record)
        if summary.initial_eval_macro_loss is None and step == 0:
            summary.initial_eval_macro_loss = result.get("macro_loss")
        summary.eval_macro_loss = result.get("macro_loss")
        summary.eval = {k: v for k, v in result.items() if not k.startswith("tokens/")}
        if self.show:
            self.out.print(
                f"eval step {step}: macro loss {result.get('macro_loss', float('nan')):.4f}  "
                + "  ".join(f"{s} {result[f'loss/{s}']:.4f}" for s in self.recipe.eval.sources)
                + note
            )
        self._last_done = time.perf_counter()

    def _track_forecast(self, step: int, record: dict[str, Any]) -> str:
        """Add `forecast` and `forecast_delta` (actual − forecast, nats) to an eval record at a progress the
        forecast covers; return the text the eval line and the live display show."""
        from marinctl.ladder import step_progress

        forecast = self.forecast.at(step_progress(step, self.recipe.train.steps)) if self.forecast else None
        if forecast is None or record.get("macro_loss") is None:
            return ""
        delta = record["macro_loss"] - forecast
        record["forecast"], record["forecast_delta"] = forecast, delta
        display = getattr(self, "_display", None)
        if display is not None:
            display.note = f"  vs forecast {delta:+.4f}"
        return f"  forecast {forecast:.4f} (actual − forecast {delta:+.4f}, {delta / forecast:+.2%})"

    def _finish(self, summary: RunSummary) -> None:
        """Plots, the per-domain eval table against the run's first evaluation, throughput figures."""
        from marinctl.train.display import eval_table
        from marinctl.train.metrics import read_metrics
        from marinctl.train.plots import write_plots

        run_dir = self.options.run_dir
        records = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else []
        evals = [r for r in records if r.get("kind") == "eval"]
        if evals:
            summary.initial_eval_macro_loss = evals[0].get("macro_loss")
        train = [r for r in records if r.get("kind") == "train" and r.get("loss") is not None]
        if summary.final_loss is None and train:  # a re-run of a finished run trains nothing
            summary.final_loss = train[-1]["loss"]
        if self._throughput:
            from marinctl.train.metrics import device_peak_flops

            steady = self._throughput[len(self._throughput) // 5 :] or self._throughput  # skip the warm-up
            summary.tokens_per_s = float(np.median([t["tokens_per_s"] for t in steady]))
            # A CPU peak read while a neighbour loads the host comes out low (0.114-0.263 TFLOP/s at start-up
            # on one machine in one session, bench/README.md stop 27) and inflates MFU: measure it again
            # now and report against the better reading. Each step's logged `mfu` keeps the start's.
            peak = max(self.peak, device_peak_flops(self._local_devices)[0])
            summary.peak_tflops = peak / 1e12
            summary.mfu = float(np.median([t["mfu"] for t in steady])) * self.peak / peak
        try:
            write_plots(run_dir)
        except UserError as err:
            log.warning("no plots: %s", err)
        if self.show and evals and self.recipe.eval.sources:
            first = evals[0] if evals[0]["step"] != evals[-1]["step"] else None
            self.out.print(eval_table(first, evals[-1], self.recipe.eval.sources))
        if self.show and summary.tokens_per_s is not None:
            self.out.print(
                f"throughput {summary.tokens_per_s:,.0f} tokens/s, MFU {summary.mfu:.2%} (median, against the "
                f"better of the start and end peaks, {summary.peak_tflops:.3f} TFLOP/s); "
                f"skipped non-finite steps: {summary.nonfinite_skipped}"
            )
        if not math.isfinite(summary.final_loss or 0.0):
            log.warning("final loss is not finite")
