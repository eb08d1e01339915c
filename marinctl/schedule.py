"""The run as a schedule: mid-run changes (`[[schedule.changes]]`, docs/recipe.md §8) resolved into segments.

The hero run was not one fixed-shape job: it switched pooled → ragged EP at 21%, changed its data mix,
and extended its context 4k → 16k → 65k with tokens per step held constant (fewer, longer sequences),
raising the QK multiplier and the capacity factor as it went. A change is data: a step (`at_step`, or
`at_fraction` of `train.steps`), a `name`, and only the keys it changes. `segments(recipe)` turns the
recipe into `[start, stop)` step ranges, each with the full effective recipe for its steps, so:

- the batch at step N is a pure function of (seed, step, schedule) (the loader reads the segments), and a
  run killed right after a transition and re-run is bitwise equal to an uninterrupted one;
- a change of seq_len, transport or capacity is a new compiled step, built at the boundary;
- what evolves (weights, optimizer state, QB bias, data position, LR schedule) passes through untouched:
  the optimizer and LR schedule come from the base recipe (tokens per step are constant by construction).

Operators record changes into a run with `marinctl switch-ep` / `marinctl extend-context`: they go to
`RUN_DIR/schedule.toml` (atomic rewrite), never into `RUN_DIR/recipe.toml`, which stays the recipe the run
was started with. Every reader of a run (`marinctl train`, `eval`, `switch-ep`, …) appends the recorded
changes to the recipe's own (`with_recorded`), so re-running `marinctl train RECIPE --run-dir DIR` keeps
them. They are applied by the next `marinctl train` of the run (a requeue); a live run does not poll.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from marinctl.errors import RecipeError, UserError
from marinctl.recipe import ChangeConfig, Recipe, recipe_to_dict

SCHEDULE_FILE = "schedule.toml"
QK_AUTO = "auto"
_HEADER = (
    "# Mid-run changes recorded by `marinctl switch-ep` / `marinctl extend-context`. The next `marinctl train`\n"
    "# of this run applies them, after the recipe's own [[schedule.changes]]. Edit only with those commands.\n"
)


def shape_key(recipe: Recipe) -> tuple:
    """What a compiled train or eval step depends on: equal keys share one executable."""
    return (recipe.train, recipe.attention, recipe.moe)


@dataclass(frozen=True)
class Segment:
    """Steps [start, stop) trained with `recipe` (the base recipe with every change up to `start` applied)."""

    start: int
    stop: int
    recipe: Recipe
    changes: tuple[dict[str, Any], ...] = ()  # identities of the changes that begin at `start`
    labels: tuple[str, ...] = ()  # their plot labels ("pooled → ragged EP", "4096 → 16384 context")

    @property
    def shape_key(self) -> tuple:
        return shape_key(self.recipe)


# --------------------------------------------------------------------------------------------------
# Resolution


def change_step(change: ChangeConfig, steps: int) -> int:
    """The first step a change applies to; fractions round to the nearest step, as data phases do."""
    if change.at_step is not None:
        return change.at_step
    return round((change.at_fraction or 0.0) * steps)


def qk_auto(base: Recipe, seq_len: int) -> float:
    """docs/recipe.md §8: qk_mult · (1 + 0.1·ln(S / S0)), S0 the run's first sequence length (1.48 at 16k,
    1.66 at 65k for the hero's 1.3 at 4k)."""
    return base.attention.qk_mult * (1.0 + 0.1 * math.log(seq_len / base.train.seq_len))


def at_context(recipe: Recipe, seq_len: int) -> Recipe:
    """`recipe` at sequence length `seq_len` with the same tokens per step and per eval batch (rows
    re-derived). An explicit `eval.batch_size` counts rows at the current context, so its tokens are held
    as the train batch's are: an eval after an extension scores the same targets at both contexts
    (`loss` and `loss@S0` compare like with like) and costs what the one before it did."""
    tokens = recipe.tokens_per_step
    train = dataclasses.replace(recipe.train, seq_len=seq_len, batch_size=tokens // seq_len)
    evaluation = recipe.eval
    if evaluation.batch_size:  # unset follows the train batch
        evaluation = dataclasses.replace(evaluation, batch_size=max(recipe.eval_tokens_per_batch // seq_len, 1))
    return recipe.replace(train=train, eval=evaluation)


def change_identity(change: ChangeConfig, steps: int) -> dict[str, Any]:
    """The change as a plain dict with its step resolved: what checkpoints remember and records carry."""
    out = recipe_to_dict(change)
    out.pop("at_fraction", None)
    out["at_step"] = change_step(change, steps)
    return out


def ordered_changes(recipe: Recipe) -> list[tuple[int, int, ChangeConfig]]:
    """(step, declaration index, change), by step then declaration order."""
    steps = recipe.train.steps
    return sorted((change_step(c, steps), i, c) for i, c in enumerate(recipe.schedule.changes))


def apply_change(base: Recipe, current: Recipe, change: ChangeConfig) -> Recipe:
    """`current` (the recipe in effect before the change) with the change's keys set."""
    out = current
    if change.train is not None and change.train.seq_len is not None:
        out = at_context(out, change.train.seq_len)
    if change.attention is not None and change.attention.qk_mult is not None:
        mult = change.attention.qk_mult
        value = qk_auto(base, out.train.seq_len) if mult == QK_AUTO else float(mult)
        out = out.replace(attention=dataclasses.replace(out.attention, qk_mult=value))
    if change.moe is not None:
        moe = {k: v for k, v in dataclasses.asdict(change.moe).items() if v is not None}
        if moe:
            out = out.replace(moe=dataclasses.replace(out.moe, **moe))
    return out


def segments(recipe: Recipe) -> list[Segment]:
    """The run's step ranges with their effective recipes; one segment when there are no changes."""
    steps = recipe.train.steps
    out: list[Segment] = []
    current, start = recipe, 0
    ids: list[dict[str, Any]] = []
    labels: list[str] = []
    by_step: dict[int, list[ChangeConfig]] = {}
    for step, _, change in ordered_changes(recipe):
        by_step.setdefault(step, []).append(change)
    for step in sorted(by_step):
        if step > start:
            out.append(Segment(start, step, current, tuple(ids), tuple(labels)))
            start, ids, labels = step, [], []
        for change in by_step[step]:
            before = current
            current = apply_change(recipe, current, change)
            ids.append(change_identity(change, steps))
            labels.append(change.name or auto_label(before, current, change))
    out.append(Segment(start, max(steps, start), current, tuple(ids), tuple(labels)))
    return out


def segment_at(segs: list[Segment], step: int) -> Segment:
    """The segment holding `step` (the last one for steps at or past the end)."""
    for seg in segs:
        if step < seg.stop:
            return seg
    return segs[-1]


def recipe_at(recipe: Recipe, step: int) -> Recipe:
    """The effective recipe for `step`."""
    return segment_at(segments(recipe), step).recipe


def applied_before(recipe: Recipe, step: int) -> list[dict[str, Any]]:
    """Identities of the changes that shaped steps < `step`: a checkpoint at `step` remembers them, so a
    resume under a schedule that rewrote its past is refused instead of silently diverging."""
    steps = recipe.train.steps
    return [change_identity(c, steps) for s, _, c in ordered_changes(recipe) if s < step]


def mixture_phases(recipe: Recipe) -> list[tuple[int, dict[str, float]]]:
    """(start step, weights) of the data mixture: `[[data.phases]]` plus changes that set data.weights."""
    from marinctl.recipe import phase_start

    steps = recipe.train.steps
    phases = [(phase_start(p, steps), dict(p.weights)) for p in recipe.data.phases]
    for step, _, change in ordered_changes(recipe):
        if change.data is not None and change.data.weights is not None:
            if not phases:  # the implicit first phase: equal weights over the non-eval sources
                train = [s.name for s in recipe.data.sources if s.name not in recipe.eval.sources]
                phases = [(0, dict.fromkeys(train, 1.0))]
            phases = [p for p in phases if p[0] != step] + [(step, dict(change.data.weights))]
            phases.sort(key=lambda p: p[0])
    return phases


def auto_label(before: Recipe, after: Recipe, change: ChangeConfig) -> str:
    """A Figure-1 style label: 'pooled → ragged EP', '4096 → 16384 context', 'cf 1.15 → 1.33', 'data mix'."""
    parts = []
    if before.moe.transport != after.moe.transport:
        parts.append(f"{before.moe.transport} → {after.moe.transport} EP")
    if before.train.seq_len != after.train.seq_len:
        parts.append(f"{_k(before.train.seq_len)} → {_k(after.train.seq_len)} context")
    if before.moe.capacity_factor != after.moe.capacity_factor:
        parts.append(f"cf {before.moe.capacity_factor:g} → {after.moe.capacity_factor:g}")
    if change.data is not None and change.data.weights is not None:
        parts.append("data mix")
    if not parts and before.attention.qk_mult != after.attention.qk_mult:
        parts.append(f"qk_mult {before.attention.qk_mult:.3g} → {after.attention.qk_mult:.3g}")
    return ", ".join(parts) or "no-op change"


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def record_fields(recipe: Recipe) -> dict[str, Any]:
    """What every train record carries about the segment it was trained in (issue: visible transitions)."""
    return {
        "seq_len": recipe.train.seq_len,
        "batch_size": recipe.train.batch_size,
        "transport": recipe.moe.transport,
        "capacity_factor": recipe.moe.capacity_factor,
        "qk_mult": recipe.attention.qk_mult,
    }


# --------------------------------------------------------------------------------------------------
# Validation (called from `marinctl.recipe.validate`, so every recipe load checks its schedule)


def validate_changes(recipe: Recipe, fail: Callable[[str, str], None]) -> None:
    """Steps in range, exactly one of at_step/at_fraction, a seq_len that divides tokens per step into
    batches the mesh can hold, real mixture sources, and no two changes at one step that disagree."""
    from marinctl.recipe import _check_ranges, _suggest

    steps, tokens = recipe.train.steps, recipe.tokens_per_step
    p = recipe.parallel
    fixed_devices = p.replica * max(p.data, 1) * max(p.expert, 1)  # a lower bound when an axis is -1 (fill)
    names = [s.name for s in recipe.data.sources]
    seen: dict[tuple[int, str], tuple[Any, int]] = {}
    for i, change in enumerate(recipe.schedule.changes):
        key = f"schedule.changes[{i}]"
        _check_ranges(change, key, fail)
        for section in ("train", "attention", "moe", "data"):
            sub = getattr(change, section)
            if sub is not None:
                _check_ranges(sub, f"{key}.{section}", fail)
        if (change.at_step is None) == (change.at_fraction is None):
            fail(key, "set exactly one of at_step and at_fraction")
        step = change_step(change, steps)
        if step >= steps > 0:
            fail(f"{key}.at_step" if change.at_step is not None else f"{key}.at_fraction",
                 f"step {step} is past the run's last step {steps - 1}")  # fmt: skip
        settings = {
            f"{section}.{k}": v
            for section in ("train", "attention", "moe", "data")
            if getattr(change, section) is not None
            for k, v in dataclasses.asdict(getattr(change, section)).items()
            if v is not None
        }
        if not settings:
            fail(key, "changes nothing: set train.seq_len, attention.qk_mult, moe.* or data.weights")
        seq_len = settings.get("train.seq_len")
        if seq_len is not None:
            where = f"{key}.train.seq_len"
            if tokens % seq_len:
                fail(where, f"{seq_len} does not divide the run's {tokens:,} tokens per step")
            rows = tokens // seq_len
            if rows % recipe.train.grad_accum or rows % fixed_devices:
                fail(where, f"{seq_len} leaves {rows} sequences per step, which do not split over the "
                            f"{fixed_devices} devices x {recipe.train.grad_accum} micro-batches")  # fmt: skip
            if recipe.attention.window > seq_len:
                fail(where, f"{seq_len} is shorter than attention.window={recipe.attention.window}")
            eval_tokens = recipe.eval_tokens_per_batch
            if recipe.eval.sources and recipe.eval.batch_size:  # unset follows the rows checked above
                if eval_tokens % seq_len or (eval_tokens // seq_len) % fixed_devices:
                    fail("eval.batch_size", f"{recipe.eval_rows} x {recipe.train.seq_len} = {eval_tokens:,} tokens per "
                                            f"eval batch do not split into rows of {where}={seq_len} over "
                                            f"{fixed_devices} device(s); a context change keeps eval tokens "
                                            "per batch")  # fmt: skip
        weights = settings.get("data.weights")
        if weights is not None:
            for name, weight in weights.items():
                if name not in names:
                    fail(f"{key}.data.weights.{name}", f"no such source{_suggest(name, names)}")
                if weight < 0 or not math.isfinite(weight):
                    fail(f"{key}.data.weights.{name}", f"must be ≥ 0 (got {weight})")
            if sum(weights.values()) <= 0:
                fail(f"{key}.data.weights", "at least one source needs a positive weight")
        for dotted, value in settings.items():
            other = seen.get((step, dotted))
            if other is not None and other[0] != value:
                fail(f"{key}.{dotted}", f"conflicts with schedule.changes[{other[1]}] at step {step} "
                                        f"({other[0]!r} vs {value!r})")  # fmt: skip
            seen[(step, dotted)] = (value, i)


# --------------------------------------------------------------------------------------------------
# Changes recorded in a run directory


def schedule_path(run_dir: Path) -> Path:
    return run_dir / SCHEDULE_FILE


def recorded_tables(run_dir: Path) -> list[dict[str, Any]]:
    """The raw `[[changes]]` tables of RUN_DIR/schedule.toml ([] when there is none)."""
    path = schedule_path(run_dir)
    if not path.is_file():
        return []
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: cannot read: {err}") from None
    changes = table.get("changes", [])
    if not isinstance(changes, list) or set(table) - {"changes"}:
        raise UserError(f"{path}: expected only [[changes]] tables")
    return changes


def with_tables(recipe: Recipe, tables: list[dict[str, Any]], source: str) -> Recipe:
    """`recipe` with `tables` appended to its changes, typed and validated; errors name `source`."""
    from marinctl.recipe import _convert, validate

    if not tables:
        return recipe
    n = len(recipe.schedule.changes)
    extra = _convert(tables, tuple[ChangeConfig, ...], "changes", {}, source)
    merged = recipe.replace(schedule=dataclasses.replace(recipe.schedule, changes=recipe.schedule.changes + extra))
    try:
        validate(merged)
    except RecipeError as err:
        prefix = "schedule.changes["
        if err.key and err.key.startswith(prefix):
            index = int(err.key[len(prefix) :].split("]", 1)[0])
            if index >= n:
                rest = err.key.split("]", 1)[1]
                raise RecipeError(source, f"changes[{index - n}]{rest}", err.message) from None
        raise
    return merged


def with_recorded(recipe: Recipe, run_dir: Path) -> Recipe:
    """The recipe plus the changes recorded in `run_dir` (what `marinctl train` of that run applies)."""
    return with_tables(recipe, recorded_tables(run_dir), str(schedule_path(run_dir)))


def load_run_recipe(run_dir: Path, overrides: list[str] | None = None) -> Recipe:
    """A run's saved recipe (with `--set`, its `[runtime]` applied) plus its recorded changes; a directory
    that is not a run is a user error."""
    from marinctl.restore import run_recipe_path
    from marinctl.stage import open_recipe

    return with_recorded(open_recipe(run_recipe_path(run_dir), overrides), run_dir)


def append_recorded(run_dir: Path, table: dict[str, Any]) -> Path:
    """Append one change to RUN_DIR/schedule.toml atomically (a reader sees the old file or the new one)."""
    path = schedule_path(run_dir)
    tables = [*recorded_tables(run_dir), table]
    tmp = path.with_name(f".{SCHEDULE_FILE}.{os.getpid()}.tmp")
    tmp.write_text(_HEADER + tomli_w.dumps({"changes": tables}), encoding="utf-8")
    os.replace(tmp, path)
    return path


def run_progress(recipe: Recipe, run_dir: Path) -> int:
    """The step the next `marinctl train` of the run starts at: its newest committed checkpoint (0: none)."""
    from marinctl.restore import checkpoint_dir, checkpoint_steps

    steps = checkpoint_steps(checkpoint_dir(recipe, run_dir))
    return steps[-1] if steps else 0


_FLAG_OF = {
    "train.seq_len": "--seq-len",
    "attention.qk_mult": "--qk-mult",
    "moe.transport": "--transport",
    "moe.capacity_factor": "--capacity-factor",
    "at_step": "--at-step",
}


def record_change(run_dir: Path, table: dict[str, Any], at_step: int | None) -> tuple[dict[str, Any], Recipe]:
    """Validate one operator change against the run and append it to RUN_DIR/schedule.toml.

    `at_step` defaults to the run's progress (its newest checkpoint): the next `marinctl train` starts
    there, so the change applies from its first step. A step already passed, a setting that conflicts
    with another change at that step, or a value the recipe rejects is a user error naming the flag, and
    the run directory is left as it was. Returns (the recorded table, the run's recipe after the change).
    """
    recipe = load_run_recipe(run_dir)
    progress = run_progress(recipe, run_dir)
    step = progress if at_step is None else at_step
    if step < progress:
        raise UserError(f"--at-step {step}: already passed (the run resumes at step {progress}, its newest checkpoint)")
    if step >= recipe.train.steps:
        raise UserError(f"--at-step {step}: past the run's last step {recipe.train.steps - 1}")
    table = {"at_step": step, **table}
    before = recipe_at(recipe, step)
    try:
        merged = with_tables(recipe, [table], "<new change>")
    except RecipeError as err:
        raise UserError(f"{_flag(err.key)}: {err.message}") from None
    if not table.get("name"):
        change = merged.schedule.changes[-1]
        table = {"name": auto_label(before, apply_change(recipe, before, change), change), **table}
        merged = with_tables(recipe, [table], "<new change>")
    _check_mesh(merged, run_dir)
    append_recorded(run_dir, table)
    return table, merged


def _check_mesh(recipe: Recipe, run_dir: Path) -> None:
    """Every segment's sequences (and eval rows) must split over the devices the run trains on, as its
    newest checkpoint records them (the recipe alone cannot say when a mesh axis is -1)."""
    from marinctl.train.launch import check_batch_divides

    devices = checkpoint_meta(recipe, run_dir).get("devices")
    if not devices:
        return
    for seg in segments(recipe):
        where = f"--seq-len {seg.recipe.train.seq_len}"
        check_batch_divides(seg.recipe, devices, 1, where=where, first_seq_len=recipe.train.seq_len)


def checkpoint_meta(recipe: Recipe, run_dir: Path) -> dict[str, Any]:
    """The JSON metadata of the run's newest checkpoint ({} when there is none)."""
    from marinctl.restore import _read_only_manager, checkpoint_dir, checkpoint_steps

    directory = checkpoint_dir(recipe, run_dir)
    steps = checkpoint_steps(directory)
    if not steps:
        return {}
    import orbax.checkpoint as ocp

    from marinctl.train.checkpoint import META

    with _read_only_manager(directory) as manager:
        return manager.restore(steps[-1], args=ocp.args.Composite(**{META: ocp.args.JsonRestore()}))[META]


def _flag(key: str | None) -> str:
    """`changes[0].train.seq_len` → `--seq-len`; other keys as they are."""
    rest = (key or "").split("]", 1)[-1].lstrip(".")
    return _FLAG_OF.get(rest, rest or "change")


def check_schedule_history(recipe: Recipe, step: int, meta: dict[str, Any], where: Path) -> None:
    """Refuse to resume from a checkpoint whose past the schedule now describes differently (a change
    recorded at a step the run had already passed, or a recipe change edited away): the resumed run would
    not be the run the schedule says. Checkpoints from before schedules existed remember none."""
    had = meta.get("schedule", [])
    want = applied_before(recipe, step)
    if had == want:
        return
    missing = [c for c in want if c not in had]
    if missing:
        c = missing[0]
        raise UserError(
            f"{where}: checkpoint {step} was trained without change {c.get('name') or c} at step {c['at_step']}; "
            f"record it at step ≥ {step} (the run went past step {c['at_step']} before the change was recorded)"
        )
    c = next(c for c in had if c not in want)
    raise UserError(
        f"{where}: checkpoint {step} was trained with change {c.get('name') or c} at step {c['at_step']}, "
        "which the schedule no longer has; restore it in the recipe or RUN_DIR/schedule.toml"
    )


def eval_recipe(recipe: Recipe, step: int, seq_len: int | None = None) -> Recipe:
    """The recipe a checkpoint at `step` is evaluated with: the one its last trained step used (context,
    qk_mult), at `seq_len` when given (tokens per batch kept, as the trainer's in-loop eval does)."""
    current = recipe_at(recipe, max(step - 1, 0))
    if seq_len is None or seq_len == current.train.seq_len:
        return current
    tokens = recipe.tokens_per_step
    if seq_len < 2 or tokens % seq_len:
        raise UserError(f"--seq-len {seq_len}: does not divide the run's {tokens:,} tokens per step")
    if recipe.attention.window > seq_len:
        raise UserError(f"--seq-len {seq_len}: shorter than attention.window={recipe.attention.window}")
    eval_tokens = current.eval_tokens_per_batch
    if eval_tokens % seq_len:
        raise UserError(f"--seq-len {seq_len}: does not divide the run's {eval_tokens:,} tokens per eval batch")
    return at_context(current, seq_len)
