"""lm-evaluation-harness on the JAX model: `MarinLM`, an `lm_eval.api.model.LM` (no PyTorch anywhere).

It serves lm-eval's three request types — `loglikelihood`, `loglikelihood_rolling` and greedy
`generate_until` — from a run directory's checkpoint, a native export or an HF export
(`marinctl.export.open_weights`). Every forward is dropless (`marinctl.export.inference_recipe`: a
training transport would drop assignments and move the logits), batched (`batch_size` rows) and jitted
on padded buckets: a row of n tokens runs in the smallest power-of-two length ≥ n (at least 32, at most
the context), so a whole evaluation compiles at most one program per bucket, never one per request
length. Padding is segment 0, which real tokens never attend to and the MoE never routes
(`marinctl.model.transformer.Block`), so a padded row scores like the unpadded one.

Token conventions follow training: every scored text starts after `<bos>` (documents were trained as
`<bos> … <eos>`), and generation stops at `<eos>` or at any `until` string.

`marinctl eval RUN_DIR --tasks T1,T2 [--include-path DIR] [--limit N]` (stages/eval.py) runs
`run_tasks`; the hub is never contacted (datasets and hub run offline), so tasks read local files, e.g.
`dataset_path: json` with `dataset_kwargs: {data_files: ...}`.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from marinctl.errors import UserError

log = logging.getLogger(__name__)

MIN_BUCKET = 32
DEFAULT_BATCH_SIZE = 8
DEFAULT_MAX_GEN_TOKS = 256
BOOTSTRAP_ITERS = 1000  # lm-eval's stderr bootstrap for non-mean metrics (its CLI's 100,000 takes minutes)


def bucket_lengths(max_length: int) -> list[int]:
    """Powers of two from MIN_BUCKET below `max_length`, then `max_length` itself."""
    out, n = [], MIN_BUCKET
    while n < max_length:
        out.append(n)
        n *= 2
    return [*out, max_length]


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} tokens exceed the longest bucket {buckets[-1]}")


@dataclass
class Scorer:
    """Jitted dropless forwards over padded (batch_size, bucket) arrays; counts its compilations."""

    recipe: Any
    params: dict[str, Any]
    router_bias: Any
    batch_size: int = DEFAULT_BATCH_SIZE
    max_length: int | None = None
    compiles: int = field(default=0, init=False)
    forwards: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        import equinox as eqx
        import jax
        import jax.numpy as jnp

        from marinctl.export import inference_model

        if self.batch_size < 1:
            raise UserError(f"--batch-size {self.batch_size}: must be ≥ 1")
        self.max_length = self.max_length or self.recipe.train.seq_len
        self.buckets = bucket_lengths(self.max_length)
        model, self.used_recipe = inference_model(self.recipe, self.params, self.batch_size * self.max_length)
        self.transport = self.used_recipe.moe.transport
        self.model = jax.device_put(model)
        self.bias = jnp.asarray(np.asarray(self.router_bias, np.float32))

        def forward(model, bias, tokens, targets, segment_ids):
            self.compiles += 1  # runs once per trace, i.e. once per compiled shape
            logits, _ = model(tokens, segment_ids, bias)
            lse = jax.nn.logsumexp(logits, axis=-1)
            picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
            return picked - lse, jnp.argmax(logits, axis=-1).astype(jnp.int32)

        self._forward = eqx.filter_jit(forward)

    def run(self, tokens: np.ndarray, targets: np.ndarray, lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(target log-probs, argmax) [batch_size, bucket] for rows given as [batch_size, bucket] arrays."""
        import jax

        segment_ids = (np.arange(tokens.shape[1])[None, :] < np.asarray(lengths)[:, None]).astype(np.int32)
        self.forwards += 1
        logp, greedy = self._forward(self.model, self.bias, tokens, targets, segment_ids)
        return np.asarray(jax.device_get(logp)), np.asarray(jax.device_get(greedy))

    def score(self, rows: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per row (inputs, targets) of equal length ≤ max_length: (log p(target_t | inputs_≤t), argmax_t)."""
        out: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0), np.zeros(0, np.int32))] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # similar lengths share a bucket
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            length = bucket_for(max(len(rows[i][0]) for i in chunk), self.buckets)
            tokens = np.zeros((self.batch_size, length), np.int32)
            targets = np.zeros((self.batch_size, length), np.int32)
            lengths = [0] * self.batch_size
            for r, i in enumerate(chunk):
                inp, tgt = rows[i]
                tokens[r, : len(inp)], targets[r, : len(tgt)], lengths[r] = inp, tgt, len(inp)
            logp, greedy = self.run(tokens, targets, lengths)
            for r, i in enumerate(chunk):
                out[i] = (logp[r, : lengths[r]], greedy[r, : lengths[r]])
        return out


def _make_lm_class():
    """The LM subclass, defined lazily so importing marinctl never imports lm_eval (an optional extra)."""
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    @register_model("marinctl")
    class MarinLM(LM):
        """lm-eval model over a marinctl checkpoint or export. `model_args`: pretrained=PATH, step=N,
        batch_size=8, max_length=(the trained context), max_gen_toks=256."""

        def __init__(
            self,
            pretrained: str,
            step: int | str | None = None,
            batch_size: int | str = DEFAULT_BATCH_SIZE,
            max_length: int | str | None = None,
            max_gen_toks: int | str = DEFAULT_MAX_GEN_TOKS,
            **_: Any,
        ) -> None:
            super().__init__()
            from marinctl.export import open_weights

            weights = open_weights(Path(pretrained), None if step in (None, "") else int(step))
            self.weights = weights
            self.tok = _tokenizer_for(weights)
            self.prefix_id = self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id
            if self.prefix_id is None:
                raise UserError(f"{pretrained}: the tokenizer has neither <bos> nor <eos> to start a text with")
            self.scorer = Scorer(
                weights.recipe,
                weights.params,
                weights.router_bias,
                batch_size=int(batch_size),
                max_length=int(max_length) if max_length else None,
            )
            self.max_length = self.scorer.max_length
            self.max_gen_toks = int(max_gen_toks)
            self.timing: dict[str, dict[str, float]] = {}

        # -- helpers ------------------------------------------------------------------------------
        def encode(self, text: str) -> list[int]:
            return [int(t) for t in self.tok.encode_batch([text])[0]] if text else []

        def _timed(self, kind: str, n: int, t0: float) -> None:
            entry = self.timing.setdefault(kind, {"requests": 0, "seconds": 0.0})
            entry["requests"] += n
            entry["seconds"] += time.perf_counter() - t0

        def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
            """(<bos> + context tokens, continuation tokens) so that the rows score exactly
            log p(continuation | context). The pair is encoded whole and split where the context's own
            tokens end; only when a merge crosses that boundary (a BPE can fuse the context's trailing
            space with the next word) are the trailing spaces moved onto the continuation first — lm-eval's
            convention for such tokenizers. A byte tokenizer never needs the move."""
            ctx = self.encode(context)
            whole = self.encode(context + continuation)
            if whole[: len(ctx)] != ctx:
                spaces = len(context) - len(context.rstrip())
                if spaces:
                    context, continuation = context[:-spaces], context[-spaces:] + continuation
                ctx = self.encode(context)
                whole = self.encode(context + continuation)
            return [self.prefix_id, *ctx], whole[len(ctx) :]

        def _pair_row(self, ctx: list[int], cont: list[int]) -> tuple[list[int], list[int]]:
            full = (ctx + cont)[-(self.max_length + 1) :]
            return full[:-1], full[1:]

        # -- lm-eval's API ------------------------------------------------------------------------
        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            t0 = time.perf_counter()
            pairs = [self.encode_pair(*req.args) for req in requests]
            rows = [self._pair_row(c, x) for c, x in pairs]
            out = []
            for req, (_, cont), (_, targets), (logp, greedy) in zip(
                requests, pairs, rows, self.scorer.score(rows), strict=True
            ):
                n = min(len(cont), len(logp))
                ll = float(np.sum(logp[len(logp) - n :], dtype=np.float64))
                is_greedy = bool(np.all(greedy[len(greedy) - n :] == np.asarray(targets[len(targets) - n :])))
                out.append((ll, is_greedy))
                self.cache_hook.add_partial("loglikelihood", req.args, (ll, is_greedy))
            self._timed("loglikelihood", len(requests), t0)
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            t0 = time.perf_counter()
            rows, owner, counts = [], [], []
            for k, req in enumerate(requests):
                windows = [
                    make_disjoint_window(w)
                    for w in get_rolling_token_windows(
                        token_list=self.encode(req.args[0]),
                        prefix_token=self.prefix_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    )
                ]
                for ctx, pred in windows:
                    full = ctx + pred
                    rows.append((full[:-1], full[1:]))
                    owner.append(k)
                    counts.append(len(pred))
            totals = [0.0] * len(requests)
            for k, n, (logp, _) in zip(owner, counts, self.scorer.score(rows), strict=True):
                totals[k] += float(np.sum(logp[len(logp) - n :], dtype=np.float64))
            for req, total in zip(requests, totals, strict=True):
                self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
            self._timed("loglikelihood_rolling", len(requests), t0)
            return totals

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            t0 = time.perf_counter()
            out: list[str] = [""] * len(requests)
            prepared = []
            for req in requests:
                context, kwargs = req.args
                kwargs = dict(kwargs or {})
                if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
                    log.warning("marinctl decodes greedily; ignoring do_sample/temperature of the task")
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
                prepared.append(
                    ([self.prefix_id, *self.encode(context)], until, max(1, min(max_new, self.max_length - 1)))
                )
            order = sorted(range(len(requests)), key=lambda i: -len(prepared[i][0]))
            bs = self.scorer.batch_size
            for start in range(0, len(order), bs):
                chunk = order[start : start + bs]
                for i, text in zip(chunk, self._generate([prepared[i] for i in chunk]), strict=True):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
            self._timed("generate_until", len(requests), t0)
            return out

        def _generate(self, batch: list[tuple[list[int], list[str], int]]) -> list[str]:
            """Greedy decoding of up to batch_size rows in one bucket (no recompilation while it grows)."""
            scorer = self.scorer
            max_new = max(m for _, _, m in batch)
            rows = [ctx[-(self.max_length - max_new) :] for ctx, _, _ in batch]
            length = bucket_for(max(len(r) for r in rows) + max_new, scorer.buckets)
            tokens = np.zeros((scorer.batch_size, length), np.int32)
            lengths = [0] * scorer.batch_size
            for r, row in enumerate(rows):
                tokens[r, : len(row)], lengths[r] = row, len(row)
            generated: list[list[int]] = [[] for _ in batch]
            done = [False] * len(batch)
            texts = [""] * len(batch)
            for _ in range(max_new):
                _, greedy = scorer.run(tokens, np.zeros_like(tokens), lengths)
                for r, (_, until, limit) in enumerate(batch):
                    if done[r]:
                        continue
                    nxt = int(greedy[r, lengths[r] - 1])
                    if nxt == self.tok.eos_id:
                        done[r] = True
                        continue
                    generated[r].append(nxt)
                    tokens[r, lengths[r]] = nxt
                    lengths[r] += 1
                    texts[r] = self.tok.decode(generated[r])
                    if any(u in texts[r] for u in until) or len(generated[r]) >= limit or lengths[r] >= length:
                        done[r] = True
                if all(done):
                    break
            results = []
            for text, (_, until, _) in zip(texts, batch, strict=True):
                cut = min((text.find(u) for u in until if u in text), default=len(text))
                results.append(text[:cut])
            return results

        @property
        def tokenizer_name(self) -> str:
            return self.tok.name

    return MarinLM


_LM_CLASS = None


def marin_lm_class():
    """`MarinLM` (registered with lm-eval as "marinctl"); a one-line error when lm-eval is not installed."""
    global _LM_CLASS
    if _LM_CLASS is None:
        try:
            import lm_eval  # noqa: F401
        except ImportError:
            raise UserError("lm-eval is not installed: pip install 'marinctl[eval]'") from None
        _LM_CLASS = _make_lm_class()
    return _LM_CLASS


def _tokenizer_for(weights):
    """The tokenizer the weights were trained with: the export's own tokenizer.json for an HF export
    (a recipe's path may not exist where the export was copied), else the recipe's `data.tokenizer`."""
    from marinctl.data.tokenizer import load_tokenizer

    spec = weights.recipe.data.tokenizer
    if weights.kind == "hf" and spec != "byte":
        path = weights.path / "tokenizer.json"
        if not path.is_file():
            raise UserError(f"{weights.path}: no tokenizer.json")
        return load_tokenizer(path)
    return load_tokenizer(spec)


def offline() -> None:
    """Nothing downloads at run time: datasets and the hub client read local files only."""
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(var, "1")


def task_manager(tasks: Sequence[str], include_path: Path | None, include_defaults: bool = True):
    """An lm-eval TaskManager that knows every name in `tasks`, else a one-line UserError.

    With `--include-path`, the directory alone is indexed first (a fraction of a second); lm-eval's
    ~15,000 built-in task files (tens of seconds to index) are read only when a name is not found there.
    """
    from lm_eval.tasks import TaskManager

    if include_path is not None and not Path(include_path).is_dir():
        raise UserError(f"--include-path {include_path}: no such directory")
    path = str(include_path) if include_path is not None else None
    if path is not None:
        manager = TaskManager(include_path=path, include_defaults=False)
        if all(t in manager.all_tasks for t in tasks):
            return manager
    if not include_defaults:
        known = manager.all_tasks if path is not None else []
    else:
        manager = TaskManager(include_path=path)
        known = manager.all_tasks
    unknown = [t for t in tasks if t not in known]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        where = f" in {include_path} or its built-in tasks" if include_path else ""
        raise UserError(f"--tasks: lm-eval knows no task {unknown[0]!r}{where}{hint}")
    return manager


def parse_tasks(spec: str) -> list[str]:
    names = [t.strip() for t in spec.split(",") if t.strip()]
    if not names:
        raise UserError("--tasks: name at least one task (comma-separated)")
    return names


def run_tasks(
    source: Path,
    tasks: Sequence[str],
    *,
    include_path: Path | None = None,
    limit: int | None = None,
    step: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_length: int | None = None,
    log_samples: bool = False,
    manager=None,
) -> dict[str, Any]:
    """lm-eval's result dict for `tasks` on `source`, plus `marinctl`: {source, kind, step, transport,
    timing per request type, compiles}. Tasks are checked before any weights are read."""
    offline()
    lm_class = marin_lm_class()
    if limit is not None and limit < 1:
        raise UserError(f"--limit {limit}: must be ≥ 1")
    manager = manager or task_manager(tasks, include_path)
    from lm_eval import simple_evaluate

    lm = lm_class(pretrained=str(source), step=step, batch_size=batch_size, max_length=max_length)
    t0 = time.perf_counter()
    results = simple_evaluate(
        model=lm,
        tasks=list(tasks),
        limit=limit,
        task_manager=manager,
        log_samples=log_samples,
        bootstrap_iters=BOOTSTRAP_ITERS,
        verbosity="ERROR",
    )
    if results is None:  # lm-eval returns None on non-zero ranks only
        raise RuntimeError("lm-eval returned no results")
    requests = sum(int(v["requests"]) for v in lm.timing.values())
    seconds = sum(v["seconds"] for v in lm.timing.values())
    results["marinctl"] = {
        "source": str(source),
        "kind": lm.weights.kind,
        "step": lm.weights.step,
        "transport": lm.scorer.transport,
        "dropless": True,
        "batch_size": batch_size,
        "max_length": lm.max_length,
        "buckets": lm.scorer.buckets,
        "compiles": lm.scorer.compiles,
        "forwards": lm.scorer.forwards,
        "timing": {
            **lm.timing,
            "total": {"requests": requests, "seconds": seconds, "wall_seconds": time.perf_counter() - t0},
            "ms_per_request": 1000.0 * seconds / requests if requests else math.nan,
        },
    }
    return results


def result_rows(results: dict[str, Any]) -> list[tuple[str, str, str, float, float | None, int | None]]:
    """(task, filter, metric, value, stderr, samples) for every numeric metric in lm-eval's results."""
    rows = []
    n_samples = results.get("n-samples", {})
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            if "," not in key or key.startswith(("alias",)) or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            if not isinstance(value, (int, float)):
                continue
            stderr = metrics.get(f"{metric}_stderr,{filt}")
            stderr = float(stderr) if isinstance(stderr, (int, float)) else None
            n = n_samples.get(task, {}).get("effective")
            rows.append((task, filt, metric, float(value), stderr, n))
    return rows


def jsonable(results: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's dict made JSON-safe with lm-eval's own serializer (numpy scalars, sets, callables)."""
    import json

    from lm_eval.utils import handle_non_serializable

    return json.loads(json.dumps(results, default=handle_non_serializable))


def eval_tasks_command(
    source: Path,
    tasks: str,
    include_path: Path | None,
    limit: int | None,
    step: int | None,
    batch_size: int,
    overrides: list[str] | None,
    as_json: bool,
    quiet: bool,
    max_length: int | None = None,
) -> None:
    """`marinctl eval SOURCE --tasks ...`: a table per task (or lm-eval's JSON with --json); `--seq-len` is
    the longest row a forward sees (default: the context of the checkpoint's step)."""
    from marinctl.export import source_kind
    from marinctl.stage import console, emit_json, open_recipe

    names = parse_tasks(tasks)
    if overrides:
        raise UserError("--set does not apply with --tasks: the checkpoint's own recipe is evaluated")
    if batch_size < 1:
        raise UserError(f"--batch-size {batch_size}: must be ≥ 1")
    kind = source_kind(source)
    if kind == "run":
        open_recipe(source / "recipe.toml", None)  # the run's [runtime] environment, before JAX starts
    marin_lm_class()  # lm-eval installed? (before indexing tasks)
    manager = task_manager(names, include_path)
    from marinctl.train.loop import configure_jax

    configure_jax()
    if max_length is not None and max_length < 2:
        raise UserError(f"--seq-len {max_length}: must be ≥ 2")
    results = run_tasks(
        source, names, limit=limit, step=step, batch_size=batch_size, max_length=max_length, manager=manager
    )
    if as_json:
        emit_json(jsonable(results))
        return
    if not quiet:
        console().print(results_table(results))


def results_table(results: dict[str, Any]):
    """A rich table: one row per task metric, then the timing line as its caption."""
    from rich.table import Table

    info = results["marinctl"]
    table = Table(
        title=f"lm-eval on {info['source']} ({info['kind']}, step {info['step']}, dropless {info['transport']})"
    )
    for name, justify in (
        ("task", "left"),
        ("metric", "left"),
        ("value", "right"),
        ("± stderr", "right"),
        ("n", "right"),
    ):
        table.add_column(name, justify=justify)
    for task, filt, metric, value, stderr, n in result_rows(results):
        label = metric if filt == "none" else f"{metric} ({filt})"
        table.add_row(task, label, f"{value:.4f}", "" if stderr is None else f"{stderr:.4f}", str(n or ""))
    timing = info["timing"]
    parts = [
        f"{kind}: {v['requests']} req, {1000 * v['seconds'] / max(v['requests'], 1):.1f} ms/req"
        for kind, v in timing.items()
        if kind in ("loglikelihood", "loglikelihood_rolling", "generate_until")
    ]
    table.caption = "; ".join(parts) + f"; {info['compiles']} compiles, {info['forwards']} forwards"
    return table
