"""Recipes: TOML files parsed into frozen dataclasses, validated with errors that name file and field.

A recipe is the single source of truth for a run (MaxText's "one base config" idea): `recipes/hero.toml`
is the base, rungs and `tiny.toml` use `extends = "hero.toml"` and override only what differs, and
`--set section.key=value` overrides on the command line, typed by the schema. The resolved recipe is
saved with every run (`recipe_to_toml`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import tomli_w

from marinctl.errors import RecipeError


def _f(default: Any, *, min: float | None = None, max: float | None = None, doc: str = "", **kw: Any) -> Any:
    """A schema field: default, inclusive numeric range, one-line doc (shown by `marinctl recipe-keys`)."""
    meta = {"min": min, "max": max, "doc": doc}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = _f(128256, min=2, doc="vocabulary size (Llama-3 tokenizer for the hero)")
    hidden: int = _f(6144, min=1, doc="D, the residual width")
    num_layers: int = _f(48, min=1, doc="L")
    num_heads: int = _f(48, min=1, doc="H, query heads")
    head_dim: int = _f(128, min=2, doc="Dh")
    init_scale: float = _f(0.5, min=0.0, doc="every matrix ~ init_scale/sqrt(D) * truncnorm(-3, 3)")
    norm_eps: float = _f(1e-5, min=0.0, doc="RMSNorm epsilon")
    embed_norm: bool = _f(True, doc="RMSNorm (+GatedNorm) right after the embedding lookup")
    gated_norm: bool = _f(True, doc="GatedNorm after every RMSNorm")
    gated_norm_rank: int = _f(128, min=1, doc="r, GatedNorm bottleneck")
    sconv_kernel: int = _f(4, min=1, doc="short causal conv taps (lag 0 = current token)")
    sconv_sites: tuple[str, ...] = _f(("keys", "attn_out", "mlp_out"), doc="where SConv runs")
    z_loss_weight: float = _f(1e-4, min=0.0, doc="logit z-loss weight (logsumexp^2)")
    ce_chunk_tokens: int = _f(
        8192, min=0, doc="lm_head + CE per chunk of this many tokens per device, remat (0: full logits at once)"
    )
    compute_dtype: Literal["auto", "float32", "bfloat16"] = _f("auto", doc="auto: bf16 on GPU/TPU, f32 on CPU")
    remat: Literal["none", "full", "save_dots", "offload"] = _f(
        "full", doc="per-block rematerialization policy (offload: full, block inputs kept in pinned host memory)"
    )


@dataclass(frozen=True)
class AttentionConfig:
    local_kv_heads: int = _f(12, min=1, doc="KV heads on local (sliding-window) layers")
    global_kv_heads: int = _f(6, min=1, doc="KV heads on global layers (the first ones of the stored heads)")
    global_every: int = _f(4, min=1, doc="layer i is global iff (i+1) % global_every == 0")
    last_layer_global: bool = _f(True, doc="the last layer is always global")
    window: int = _f(2048, min=1, doc="sliding window of local layers")
    rope_theta: float = _f(10000.0, min=1.0, doc="RoPE base")
    rope_fraction: float = _f(0.5, min=0.0, max=1.0, doc="fraction of head dims rotated on local layers")
    nope_global: bool = _f(True, doc="global layers use no positional encoding")
    qk_norm: bool = _f(True, doc="non-parametric RMSNorm on q and k per head")
    qk_norm_eps: float = _f(1e-6, min=0.0, doc="QK RMSNorm epsilon")
    qk_mult: float = _f(1.3, min=0.0, doc="fixed multiplier on q after QK norm (raised on context extension)")
    qk_mult_learnable: bool = _f(False, doc="ablation: learnable per-head multiplier")
    xsa: bool = _f(True, doc="exclusive self attention")
    gate: bool = _f(True, doc="head-wise gate 2*sigmoid(a W_gate)")
    impl: Literal["auto", "xla", "cudnn"] = _f("auto", doc="auto: cuDNN flash attention on GPU, XLA elsewhere")


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = _f(384, min=1, doc="E routed experts")
    top_k: int = _f(8, min=1, doc="K experts per token")
    expert_width: int = _f(3072, min=1, doc="I, routed expert hidden width")
    latent: bool = _f(True, doc="run experts in a down-projected latent (LatentMoE)")
    latent_width: int = _f(3072, min=1, doc="l, latent width (D/2 is 2x compression)")
    latent_norm: bool = _f(True, doc="learnable RMSNorm on the latent")
    shared_experts: int = _f(2, min=0, doc="full-width shared SwiGLU experts")
    shared_width: int = _f(3072, min=1, doc="shared expert hidden width")
    router_weight_sum: float = _f(2.5, min=0.0, doc="combine weights renormalized to this sum")
    transport: Literal["dense", "fixed", "pooled", "ragged"] = _f("pooled", doc="expert-parallel transport")
    capacity_factor: float = _f(1.15, min=0.0, doc="cf for fixed cells / pooled receiver buffers")
    sender_capacity_factor: float | None = _f(None, min=0.0, doc="cf_t for pooled sender pools (default: cf)")
    waves: int = _f(3, min=1, doc="W, pooled waves")
    ragged_buffer_factor: float | None = _f(
        None, min=0.0, doc="ragged receive buffer in units of T*K rows (default: worst case, never drops)"
    )
    balancing: Literal["quantile", "none"] = _f("quantile", doc="router bias from quantile balancing")
    qb_estimator: Literal["histogram", "exact"] = _f("histogram", doc="live-range histogram or exact sort")
    qb_bins: int = _f(10000, min=2, doc="histogram bins")
    qb_variant: Literal["logit", "post_sigmoid"] = _f("logit", doc="bias on raw logits (hero) or after sigmoid")


@dataclass(frozen=True)
class OptimizerConfig:
    adam_lr: float | None = _f(None, min=0.0, doc="Adam LR (default: docs/recipe.md §5 heuristic)")
    muonh_lr: float | None = _f(None, min=0.0, doc="MuonH LR (default: 13/3 * adam_lr, capped 0.05)")
    adamh_lr: float | None = _f(None, min=0.0, doc="AdamH (lm_head) LR (default: the MuonH LR)")
    beta1: float | None = _f(None, min=0.0, max=1.0, doc="default 0.9062")
    beta2: float | None = _f(None, min=0.0, max=1.0, doc="default clip(0.999^(B/131072), 0.95, 0.9999)")
    epsilon: float | None = _f(None, min=0.0, doc="default 9.676e-18 * sqrt(total tokens / B)")
    muon_momentum: float = _f(0.95, min=0.0, max=1.0, doc="Muon momentum (Nesterov)")
    ns_coefficients: Literal["tuned", "simple"] = _f("tuned", doc="Newton-Schulz coefficient table")
    ns_steps: int = _f(5, min=1, doc="Newton-Schulz iterations")
    weight_decay: float = _f(0.0, min=0.0, doc="decoupled WD on attention gate and router, annealed to 0")
    grad_clip: float = _f(0.0, min=0.0, doc="global-norm clip; 0 = off (the hero ran without)")


# Mid-run changes (`[[schedule.changes]]`, docs/recipe.md §8): each names the step it starts at and only the
# keys it changes (None = unchanged). `marinctl.schedule` resolves them into the run's segments.
@dataclass(frozen=True)
class ChangeTrainConfig:
    seq_len: int | None = _f(None, min=2, doc="new S; train.batch_size is re-derived so tokens per step stay")


@dataclass(frozen=True)
class ChangeAttentionConfig:
    qk_mult: float | Literal["auto"] | None = _f(None, min=0.0, doc="'auto' = qk_mult·(1 + 0.1·ln(S/S0))")


@dataclass(frozen=True)
class ChangeMoEConfig:
    transport: Literal["dense", "fixed", "pooled", "ragged"] | None = _f(None, doc="expert-parallel transport")
    capacity_factor: float | None = _f(None, min=0.0, doc="cf for fixed cells / pooled receiver buffers")
    sender_capacity_factor: float | None = _f(None, min=0.0, doc="cf_t for pooled sender pools")
    waves: int | None = _f(None, min=1, doc="W, pooled waves")
    ragged_buffer_factor: float | None = _f(None, min=0.0, doc="bounded ragged receive buffer (T*K rows)")


@dataclass(frozen=True)
class ChangeDataConfig:
    weights: dict[str, float] | None = _f(None, doc="the new mixture: source name -> sampling weight")


@dataclass(frozen=True)
class ChangeConfig:
    name: str = _f("", doc="label on plots and in the change record")
    at_step: int | None = _f(None, min=0, doc="first step the change applies to")
    at_fraction: float | None = _f(None, min=0.0, max=1.0, doc="or: that step as a share of train.steps")
    train: ChangeTrainConfig | None = _f(None, doc="train.seq_len")
    attention: ChangeAttentionConfig | None = _f(None, doc="attention.qk_mult")
    moe: ChangeMoEConfig | None = _f(None, doc="transport and capacity knobs")
    data: ChangeDataConfig | None = _f(None, doc="data.weights")


@dataclass(frozen=True)
class ScheduleConfig:
    warmup_fraction: float = _f(0.01, min=0.0, max=1.0, doc="linear warmup from 0 over this share of steps")
    warmup_steps: int | None = _f(None, min=0, doc="explicit warmup steps (overrides the fraction)")
    final_lr_fraction: float = _f(0.05, min=0.0, max=1.0, doc="linear decay to this share of peak")
    changes: tuple[ChangeConfig, ...] = _f(
        (),
        doc="[[schedule.changes]] mid-run changes: at_step or at_fraction, name, and any of train.seq_len, "
        "attention.qk_mult, moe.transport/capacity knobs, data.weights",
    )


@dataclass(frozen=True)
class SourceConfig:
    name: str = _f("", doc="source name (metrics: loss/<name>)")
    path: str = _f("", doc="store directory, relative to data.root")


@dataclass(frozen=True)
class PhaseConfig:
    start_step: int | None = _f(None, min=0, doc="first step of the phase")
    start_fraction: float | None = _f(None, min=0.0, max=1.0, doc="or: first step as a share of train.steps")
    weights: dict[str, float] = _f({}, doc="source name -> sampling weight")


@dataclass(frozen=True)
class DataConfig:
    root: str = _f("data", doc="directory holding the token stores (relative to the recipe's cwd)")
    tokenizer: str = _f("byte", doc="'byte' or a path to an HF tokenizer.json")
    builtin: str = _f("", doc="built-in corpus tokenized into root when missing ('' = none)")
    seed: int = _f(0, doc="sampling seed; batch(step) is a pure function of (seed, step)")
    prefetch: int = _f(2, min=0, doc="batches prepared ahead in the background")
    sources: tuple[SourceConfig, ...] = _f((), doc="[[data.sources]] tables")
    phases: tuple[PhaseConfig, ...] = _f((), doc="[[data.phases]] tables: mixture weights from a step on")


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = _f(4096, min=2, doc="S, tokens per sequence")
    batch_size: int = _f(11264, min=1, doc="global sequences per step")
    steps: int = _f(390251, min=0, doc="optimizer steps; 0 = from tokens_per_active_param")
    tokens_per_active_param: float = _f(0.0, min=0.0, doc="steps = round(this * active / tokens_per_step)")
    grad_accum: int = _f(1, min=1, doc="micro-batches per step")
    seed: int = _f(0, doc="parameter init seed")
    max_nonfinite_steps: int = _f(10, min=1, doc="consecutive non-finite steps before abort")


@dataclass(frozen=True)
class ParallelConfig:
    replica: int = _f(1, min=1, doc="data-parallel replicas (racks) over the data-centre network")
    data: int = _f(-1, min=-1, doc="FSDP/data axis inside a replica; -1 fills remaining devices")
    expert: int = _f(1, min=-1, doc="expert-parallel axis; -1 fills remaining devices")


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = _f(1000, min=0, doc="save every N steps (0: only at the end)")
    keep_last: int = _f(3, min=1, doc="keep the newest K checkpoints")
    keep_every: int = _f(0, min=0, doc="also keep every M-th step forever (0: none)")
    async_save: bool = _f(True, doc="write checkpoints in the background")
    dir: str = _f("", doc="checkpoint directory (default RUN_DIR/checkpoints)")


@dataclass(frozen=True)
class EvalConfig:
    every: int = _f(0, min=0, doc="evaluate every N steps (0: at the start and end only)")
    batches: int = _f(4, min=1, doc="batches per eval source")
    batch_size: int | None = _f(
        None, min=1, doc="eval sequences per batch (default train.batch_size); a context change keeps its tokens"
    )
    sources: tuple[str, ...] = _f((), doc="zero-weight data sources evaluated (dropless)")
    ladder_grid: bool = _f(False, doc="also evaluate at every 5% of progress: the ladder grid (docs/recipe.md §9)")
    forecast: str = _f("", doc="forecast.json from `ladder fit --out`: eval records carry forecast and delta")


@dataclass(frozen=True)
class LogConfig:
    every: int = _f(1, min=1, doc="metrics.jsonl cadence")
    norms_every: int = _f(100, min=0, doc="per-matrix norms / per-group grad norms cadence (0: off)")
    tensorboard: bool = _f(False, doc="also write TensorBoard events")
    wandb: bool = _f(False, doc="also log to Weights & Biases (offline unless configured)")
    wandb_project: str = _f("marinctl", doc="W&B project")
    norm_drift_tol: float = _f(0.01, min=0.0, doc="warn when a hyperball matrix leaves its init norm by more")
    norm_jump_tol: float = _f(0.5, min=0.0, doc="warn when any matrix norm changes by more in one step")
    embed_spike_factor: float = _f(10.0, min=1.0, doc="warn on embed grad norm > k x running median")
    dead_expert_tol: float = _f(1e-3, min=0.0, doc="expert grad norm below tol x median counts as dead")


@dataclass(frozen=True)
class RuntimeConfig:
    env: dict[str, str] = _f({}, doc="environment variables set before JAX starts")
    xla_flags: tuple[str, ...] = _f((), doc="appended to XLA_FLAGS before JAX starts")
    precompile: bool = _f(True, doc="compile the schedule's later train and eval steps on a background thread")


@dataclass(frozen=True)
class Recipe:
    name: str = _f("", doc="recipe name")
    description: str = _f("", doc="one line")
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    # Where the recipe came from (not a TOML key); errors and the run dir name it.
    source: str = field(default="<recipe>", compare=False, metadata={"internal": True})

    @property
    def tokens_per_step(self) -> int:
        return self.train.batch_size * self.train.seq_len

    @property
    def eval_rows(self) -> int:
        """Sequences per eval batch: `eval.batch_size`, or the train batch's when it is unset."""
        return self.eval.batch_size or self.train.batch_size

    @property
    def eval_tokens_per_batch(self) -> int:
        """What a context change holds for the eval, as `tokens_per_step` for the train batch."""
        return self.eval_rows * self.train.seq_len

    @property
    def total_tokens(self) -> int:
        return self.tokens_per_step * self.train.steps

    @property
    def stored_kv_heads(self) -> int:
        """KV heads stored per layer: global layers use the first `global_kv_heads` of them (docs/recipe.md §2.2)."""
        return max(self.attention.local_kv_heads, self.attention.global_kv_heads)

    def layer_is_global(self) -> tuple[bool, ...]:
        """Layer i (0-based) is global iff (i+1) % global_every == 0, or it is the last layer (docs/recipe.md §1)."""
        n, every = self.model.num_layers, self.attention.global_every
        last = self.attention.last_layer_global
        return tuple((i + 1) % every == 0 or (last and i == n - 1) for i in range(n))

    def replace(self, **sections: Any) -> Recipe:
        return dataclasses.replace(self, **sections)


SECTIONS = tuple(f.name for f in dataclasses.fields(Recipe) if dataclasses.is_dataclass(f.default_factory))


# --------------------------------------------------------------------------------------------------
# Loading: TOML -> merged dict (with `extends`) -> --set overrides -> typed dataclasses -> validation.


def load_recipe(path: str | Path, overrides: typing.Sequence[str] = ()) -> Recipe:
    """Load, merge, override, type-check and validate a recipe; raise `RecipeError` on any mistake."""
    path = Path(path)
    provenance: dict[str, str] = {}
    merged = _load_with_extends(path, [], provenance)
    for item in overrides:
        _apply_override(merged, item, provenance)
    recipe = _build(Recipe, merged, "", provenance, str(path))
    recipe = dataclasses.replace(recipe, source=str(path))
    recipe = _resolve_steps(recipe, provenance)
    validate(recipe, provenance)
    return recipe


def _load_with_extends(path: Path, stack: list[Path], provenance: dict[str, str]) -> dict:
    shown = str(path)
    if not path.is_file():
        where = stack[-1] if stack else None
        if where is not None:
            raise RecipeError(str(where), "extends", f"no such recipe file {shown}")
        raise RecipeError(shown, None, "no such recipe file")
    resolved = path.resolve()
    if resolved in stack:
        chain = " -> ".join(p.name for p in [*stack, resolved])
        raise RecipeError(shown, "extends", f"cycle in extends ({chain})")
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise RecipeError(shown, None, f"invalid TOML: {err}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError(shown, None, f"cannot read: {err}") from None
    parent_ref = table.pop("extends", None)
    merged: dict = {}
    if parent_ref is not None:
        if not isinstance(parent_ref, str):
            raise RecipeError(shown, "extends", f"must be a path string (got {parent_ref!r})")
        merged = _load_with_extends(path.parent / parent_ref, [*stack, resolved], provenance)
    _merge(merged, table, "", provenance, shown)
    return merged


def _merge(base: dict, over: dict, prefix: str, provenance: dict[str, str], source: str) -> None:
    """Deep-merge tables; arrays (including arrays of tables) replace, as a child recipe expects."""
    for key, value in over.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and isinstance(base.get(key), dict) and not _is_map_field(dotted):
            _merge(base[key], value, dotted + ".", provenance, source)
        else:
            base[key] = value
            _mark(value, dotted, provenance, source)


def _mark(value: Any, dotted: str, provenance: dict[str, str], source: str) -> None:
    provenance[dotted] = source
    if isinstance(value, dict):
        for key, child in value.items():
            _mark(child, f"{dotted}.{key}", provenance, source)


def _is_map_field(dotted: str) -> bool:
    """Fields typed dict[...] are values, replaced whole rather than merged key by key."""
    parts = dotted.split(".")
    if len(parts) != 2 or parts[0] not in SECTIONS:
        return False
    cls = _section_class(parts[0])
    hints = typing.get_type_hints(cls)
    return typing.get_origin(hints.get(parts[1])) is dict


def _section_class(name: str) -> type:
    return typing.get_type_hints(Recipe)[name]


def _apply_override(merged: dict, item: str, provenance: dict[str, str]) -> None:
    if "=" not in item:
        raise RecipeError("--set", item, "expected section.key=value")
    dotted, raw = item.split("=", 1)
    dotted = dotted.strip()
    parts = dotted.split(".")
    if len(parts) != 2:
        raise RecipeError("--set", dotted, "expected section.key=value")
    section, key = parts
    if section not in SECTIONS:
        raise RecipeError("--set", dotted, f"unknown section{_suggest(section, SECTIONS)}")
    cls = _section_class(section)
    hints = typing.get_type_hints(cls)
    if key not in hints:
        raise RecipeError("--set", dotted, f"unknown key{_suggest(key, list(hints))}")
    merged.setdefault(section, {})[key] = _parse_override_value(raw.strip(), hints[key], dotted)
    provenance[dotted] = "--set"


def _parse_override_value(raw: str, hint: Any, dotted: str) -> Any:
    """Type a `--set` value by the schema: 'auto'/'none' clear optional fields, TOML syntax otherwise."""
    if _optional_inner(hint) is not None and raw.lower() in ("auto", "none", "null"):
        return None
    inner = _optional_inner(hint) or hint
    if inner is str or typing.get_origin(inner) is Literal:
        return raw
    if inner is bool:
        lowered = raw.lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise RecipeError("--set", dotted, f"expected a boolean (got {raw!r})")
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        if typing.get_origin(inner) is tuple and typing.get_args(inner)[0] is str:
            return [s.strip() for s in raw.split(",") if s.strip()]
        raise RecipeError("--set", dotted, f"cannot parse {raw!r} as {_type_name(inner)}") from None


def _optional_inner(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(hint)) == 2:
            return args[0]
    return None


def _type_name(hint: Any) -> str:
    inner = _optional_inner(hint)
    if inner is not None:
        return f"{_type_name(inner)} or 'auto'"
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(hint) if a is not type(None))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(hint))
    if origin is tuple:
        return f"an array of {_type_name(typing.get_args(hint)[0])}"
    if origin is dict:
        return "a table"
    if dataclasses.is_dataclass(hint):
        return "a table"
    return {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}.get(hint, str(hint))


def _suggest(word: str, options: typing.Iterable[str]) -> str:
    match = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _build(cls: type, table: Any, prefix: str, provenance: dict[str, str], default_src: str) -> Any:
    if not isinstance(table, dict):
        src = provenance.get(prefix.rstrip("."), default_src)
        raise RecipeError(src, prefix.rstrip(".") or None, f"expected a table (got {table!r})")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
    kwargs = {}
    for key, value in table.items():
        dotted = f"{prefix}{key}"
        src = provenance.get(dotted, default_src)
        if key not in names:
            raise RecipeError(src, dotted, f"unknown key{_suggest(key, names)}")
        kwargs[key] = _convert(value, hints[key], dotted, provenance, src)
    return cls(**kwargs)


def _convert(value: Any, hint: Any, dotted: str, provenance: dict[str, str], src: str) -> Any:
    def wrong() -> RecipeError:
        return RecipeError(src, dotted, f"expected {_type_name(hint)} (got {value!r})")

    inner = _optional_inner(hint)
    if inner is not None:
        return None if value is None else _convert(value, inner, dotted, provenance, src)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # e.g. float | Literal["auto"] | None: the first arm that fits
        if value is None and type(None) in typing.get_args(hint):
            return None
        for arm in typing.get_args(hint):
            try:
                return _convert(value, arm, dotted, provenance, src)
            except RecipeError:
                continue
        raise wrong()
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, dotted + ".", provenance, src)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise RecipeError(src, dotted, f"must be {_type_name(hint)} (got {value!r})")
        return value
    if origin is tuple:
        if not isinstance(value, list):
            raise wrong()
        item_hint = typing.get_args(hint)[0]
        return tuple(_convert(v, item_hint, f"{dotted}[{i}]", provenance, src) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise wrong()
        _, val_hint = typing.get_args(hint)
        return {str(k): _convert(v, val_hint, f"{dotted}.{k}", provenance, src) for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise wrong()
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong()
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong()
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise wrong()
        return value
    raise wrong()


def _resolve_steps(recipe: Recipe, provenance: dict[str, str]) -> Recipe:
    """`train.steps = 0` means: derive from tokens per active parameter (docs/recipe.md §9's 791 rule)."""
    if recipe.train.steps > 0:
        return recipe
    src = provenance.get("train.steps", recipe.source)
    if recipe.train.tokens_per_active_param <= 0:
        raise RecipeError(src, "train.steps", "is 0 but train.tokens_per_active_param is not set")
    from marinctl.counting import count_params  # counting depends on the schema, not the reverse

    active = count_params(recipe).active
    steps = max(1, round(recipe.train.tokens_per_active_param * active / recipe.tokens_per_step))
    return recipe.replace(train=dataclasses.replace(recipe.train, steps=steps))


# --------------------------------------------------------------------------------------------------
# Validation: ranges from field metadata, then the cross-field rules.


def validate(recipe: Recipe, provenance: dict[str, str] | None = None) -> None:
    provenance = provenance or {}

    def fail(dotted: str, message: str) -> None:
        raise RecipeError(provenance.get(dotted, recipe.source), dotted, message)

    for section in SECTIONS:
        _check_ranges(getattr(recipe, section), section, fail)
    for i, src in enumerate(recipe.data.sources):
        _check_ranges(src, f"data.sources[{i}]", fail)
    for i, phase in enumerate(recipe.data.phases):
        _check_ranges(phase, f"data.phases[{i}]", fail)

    m, a, moe, t, p = recipe.model, recipe.attention, recipe.moe, recipe.train, recipe.parallel
    if m.hidden % m.head_dim:
        fail("model.hidden", f"must be divisible by model.head_dim={m.head_dim} (got {m.hidden})")
    if m.num_heads % a.local_kv_heads:
        fail("attention.local_kv_heads", f"must divide model.num_heads={m.num_heads} (got {a.local_kv_heads})")
    if m.num_heads % a.global_kv_heads:
        fail("attention.global_kv_heads", f"must divide model.num_heads={m.num_heads} (got {a.global_kv_heads})")
    rope_dims = m.head_dim * a.rope_fraction
    if rope_dims != int(rope_dims) or int(rope_dims) % 2:
        fail("attention.rope_fraction", f"must rotate an even number of head dims (got {rope_dims:g})")
    if a.window > t.seq_len:
        fail("attention.window", f"must be ≤ train.seq_len={t.seq_len} (got {a.window})")
    bad_sites = set(m.sconv_sites) - {"keys", "values", "attn_out", "mlp_out"}
    if bad_sites:
        fail("model.sconv_sites", f"unknown site {sorted(bad_sites)[0]!r} (keys, values, attn_out, mlp_out)")
    if moe.top_k > moe.num_experts:
        fail("moe.top_k", f"must be ≤ num_experts (got {moe.top_k})")
    if moe.balancing == "quantile" and moe.top_k == moe.num_experts:
        fail("moe.top_k", f"must be < num_experts for quantile balancing (got {moe.top_k})")
    if p.expert > 0 and moe.num_experts % p.expert:
        fail("parallel.expert", f"must divide moe.num_experts={moe.num_experts} (got {p.expert})")
    if p.data == 0 or p.expert == 0:
        fail("parallel.data" if p.data == 0 else "parallel.expert", "must be ≥ 1 or -1 (fill)")
    if p.data == -1 and p.expert == -1:
        fail("parallel.expert", "only one of parallel.data and parallel.expert may be -1")
    fixed = p.replica * max(p.data, 1) * max(p.expert, 1)
    if p.data > 0 and p.expert > 0 and t.batch_size % fixed:
        fail("train.batch_size", f"must be divisible by the {fixed} devices of the mesh (got {t.batch_size})")
    if t.batch_size % t.grad_accum:
        fail("train.grad_accum", f"must divide train.batch_size={t.batch_size} (got {t.grad_accum})")

    names = [s.name for s in recipe.data.sources]
    for i, src in enumerate(recipe.data.sources):
        if not src.name:
            fail(f"data.sources[{i}].name", "must be set")
        if names.count(src.name) > 1:
            fail(f"data.sources[{i}].name", f"duplicate source name {src.name!r}")
    starts = []
    for i, phase in enumerate(recipe.data.phases):
        key = f"data.phases[{i}]"
        if (phase.start_step is None) == (phase.start_fraction is None):
            fail(key, "set exactly one of start_step and start_fraction")
        starts.append(phase_start(phase, t.steps))
        for name, weight in phase.weights.items():
            if name not in names:
                fail(f"{key}.weights.{name}", f"no such source{_suggest(name, names)}")
            if weight < 0 or not math.isfinite(weight):
                fail(f"{key}.weights.{name}", f"must be ≥ 0 (got {weight})")
        if sum(phase.weights.values()) <= 0:
            fail(f"{key}.weights", "at least one source needs a positive weight")
    if starts and starts[0] != 0:
        fail("data.phases[0]", "the first phase must start at step 0")
    if starts != sorted(starts):
        fail("data.phases", "phases must be in increasing start order")
    for i, name in enumerate(recipe.eval.sources):
        if name not in names:
            fail(f"eval.sources[{i}]", f"no such data source {name!r}{_suggest(name, names)}")
    from marinctl.schedule import validate_changes  # the schedule module reads the schema, not the reverse

    validate_changes(recipe, fail)


def phase_start(phase: PhaseConfig, steps: int) -> int:
    """First step of a mixture phase; fractions round to the nearest step (the hero switched at 80%)."""
    if phase.start_step is not None:
        return phase.start_step
    return round((phase.start_fraction or 0.0) * steps)


def _check_ranges(obj: Any, prefix: str, fail: typing.Callable[[str, str], None]) -> None:
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        lo, hi = f.metadata.get("min"), f.metadata.get("max")
        if lo is not None and value < lo:
            fail(f"{prefix}.{f.name}", f"must be ≥ {lo:g} (got {value:g})")
        if hi is not None and value > hi:
            fail(f"{prefix}.{f.name}", f"must be ≤ {hi:g} (got {value:g})")


# --------------------------------------------------------------------------------------------------
# Writing: the resolved recipe saved in every run dir; loading it back gives an equal Recipe.


def recipe_to_dict(recipe: Recipe) -> dict:
    def clean(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            out = {}
            for f in dataclasses.fields(value):
                if f.metadata.get("internal"):
                    continue
                v = getattr(value, f.name)
                if v is not None:  # TOML has no null: an omitted optional means "auto"
                    out[f.name] = clean(v)
            return out
        if isinstance(value, tuple):
            return [clean(v) for v in value]
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        return value

    return clean(recipe)


def recipe_to_toml(recipe: Recipe) -> str:
    return tomli_w.dumps(recipe_to_dict(recipe))


def schema_keys() -> list[tuple[str, str, Any, str]]:
    """(dotted key, type, default, doc) for every recipe key: the README's reference and `--set` help."""
    rows = []
    for section in SECTIONS:
        cls = _section_class(section)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((f"{section}.{f.name}", _type_name(hints[f.name]), default, f.metadata.get("doc", "")))
    return rows
