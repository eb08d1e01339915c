"""The loader (docs/recipe.md §6): packed sequences with segment ids from a phased mixture, a pure function of the step.

Row r of step n's global batch is built from (seed, n, r) alone:
1. **Source** (mixture with phases). Rows are numbered globally, g = n·B + r; inside a phase they fall
   into blocks of `BLOCK_ROWS`. Each block holds each source exactly `round(weight · BLOCK_ROWS)` times
   (largest remainder), in an order shuffled by (seed, phase, block) — Levanter's block-deterministic
   mixture. So proportions are exact per block, and "how many rows of source s came before g" has a
   closed form: a resumed or multi-host run needs no history.
2. **Window** (packing). A source's documents (each `<bos> … <eos>`) are concatenated and cut into windows
   of S+1 tokens starting at `shift + w·S`; the k-th row drawn from a source is window
   `permute(k mod W)` of epoch `k div W`, with a Feistel permutation and shift keyed by (seed, source,
   epoch). Every epoch visits every window once, in a fresh order and with fresh cut points.
3. **Segments and loss mask.** `tokens = window[:S]`, `targets = window[1:]` (the next token is
   provided, so the last position is trained too). Segment ids count documents from 1 inside the row and
   change exactly at document starts; a document cut by the window start continues with id 1 (a
   continuation is a fresh segment: it cannot attend to its own beginning in the previous row).
   `loss_mask[t] = 0` where `targets[t]` starts another document (docs/recipe.md §6: no cross-document targets).
Segment id 0 (padding) only appears in `eval_batches`, whose last window of a source is partial.

**Schedules** (`marinctl.schedule`, docs/recipe.md §8). A change of `train.seq_len` mid-run re-derives the
batch size (tokens per step constant), so rows are numbered over the whole run with a piecewise batch
size: g counts rows before the step, whatever their length. The mixture (1.) is over those rows and does
not see the length. Windows (2.) do: within a stretch of constant length S the k-th row of a source is
window `off + (k − K)`, where K is the rows the source gave before the stretch and `off = ⌈T / S⌉` with T
the tokens those rows covered, so each source's epoch continues at the same token position in the new
length's window order. Everything is still a closed form of (seed, step, schedule); without a change of
length, off = K = 0 and the batches are the ones a schedule-free run reads.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from marinctl.data.store import JaggedStore
from marinctl.errors import UserError
from marinctl.recipe import Recipe

BLOCK_ROWS = 2048  # mixture block: weights are honoured exactly per 2048 rows (resolution 1/2048)
_IN_MEMORY_BYTES = 1 << 30  # sources up to this size are read into memory once; larger ones per window
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass(frozen=True)
class Phase:
    start_step: int
    sources: tuple[str, ...]  # sources with positive weight, in recipe order
    counts: tuple[int, ...]  # rows per block for each of them (sum = BLOCK_ROWS)


class _Source:
    def __init__(self, name: str, store: JaggedStore):
        self.name, self.store = name, store
        self.n_tokens = store.num_tokens
        self.offsets = store.offsets
        self.tokens_dtype = np.dtype(store.manifest["dtype"])
        nbytes = self.n_tokens * self.tokens_dtype.itemsize
        self.tokens = store.read_tokens() if nbytes <= _IN_MEMORY_BYTES else None
        self.key = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")

    def read(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows tokens[s : s+length] and where they are real; reads past the end are padded with 0."""
        index = starts[:, None] + np.arange(length)
        valid = index < self.n_tokens
        if self.tokens is not None:
            window = self.tokens[np.minimum(index, self.n_tokens - 1)]
        elif valid.all():
            window = self.store.read_many(starts, length)
        else:
            window = np.zeros(index.shape, self.tokens_dtype)
            for i, s in enumerate(starts):
                row = self.store.read_tokens(int(s), min(int(s) + length, self.n_tokens))
                window[i, : len(row)] = row
        return np.where(valid, window, 0), valid


class Loader:
    """Batches of {tokens, targets, segment_ids, loss_mask}, each [rows, seq_len], from the recipe's data."""

    def __init__(self, recipe: Recipe, root: str | Path | None = None):
        data = recipe.data
        self.recipe = recipe
        self.root = Path(root if root is not None else data.root)
        self.seq_len, self.batch_size = recipe.train.seq_len, recipe.train.batch_size  # the run's first shape
        self.seed, self.prefetch, self.steps = data.seed, data.prefetch, recipe.train.steps
        self.paths = {s.name: self.root / s.path for s in data.sources}
        if not self.paths:
            raise UserError(f"{recipe.source}: data.sources is empty: name at least one token store")
        self.stretches = _stretches(recipe)
        self._stretch_rows = _stretch_rows(self.stretches)
        self.phases = _phases(recipe)
        self._phase_rows = [self.rows_before(p.start_step) for p in self.phases]
        self._sources: dict[str, _Source] = {}
        for name in dict.fromkeys([*(n for phase in self.phases for n in phase.sources), *recipe.eval.sources]):
            self.source(name)  # fail at start-up, not at the step (or eval) that first needs a source
        self._blocks: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        self._used = self._used_before_phases()
        self._consumed = [
            np.array([used.get(n, 0) for n in ph.sources], np.int64)
            for used, ph in zip(self._used, self.phases, strict=True)
        ]
        self._offsets = self._stretch_offsets()

    # ---------------------------------------------------------------------------------------------
    # Public API

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """The global batch of `step`: [train.batch_size, train.seq_len] arrays."""
        return self.host_batch(step, 0, 1)

    def host_batch(self, step: int, process_index: int, process_count: int) -> dict[str, np.ndarray]:
        """This host's contiguous share of the global batch (rows i·B/P … (i+1)·B/P − 1), read alone."""
        if process_count < 1 or not 0 <= process_index < process_count:
            raise UserError(f"process {process_index} of {process_count}: not a valid host index")
        batch_size = self.shape(step)[0]
        if batch_size % process_count:
            raise UserError(f"train.batch_size {batch_size} does not split over {process_count} hosts")
        per_host = batch_size // process_count
        rows = np.arange(process_index * per_host, (process_index + 1) * per_host)
        return self._rows(step, rows)

    def iterate(
        self, start_step: int, stop_step: int | None = None, *, process_index: int = 0, process_count: int = 1
    ) -> Prefetcher:
        """Batches for steps start_step, start_step+1, … (to train.steps), prepared `data.prefetch` ahead."""
        stop = self.steps if stop_step is None else stop_step
        produce = (self.host_batch(s, process_index, process_count) for s in range(start_step, stop))
        return Prefetcher(produce, self.prefetch)

    def eval_batches(
        self, source: str, n_batches: int, batch_size: int | None = None, seq_len: int | None = None
    ) -> Iterator[dict[str, np.ndarray]]:
        """The source's first `n_batches·batch_size` windows of `seq_len` (default the run's first) in order
        (deterministic; each target scored once); stops early when the source is exhausted, padding the
        last batch (segment 0, mask 0)."""
        src = self.source(source)
        S, bs = seq_len or self.seq_len, batch_size or self.batch_size
        n_windows = -(-(src.n_tokens - 1) // S)  # ceil: the last window may be partial
        for b in range(n_batches):
            first = b * bs
            if first >= n_windows:
                return
            starts = np.arange(first, min(first + bs, n_windows), dtype=np.int64) * S
            window, valid = src.read(starts, S + 1)
            batch = self._pack(src, starts, window, valid, S)
            if len(starts) < bs:
                batch = {k: np.concatenate([v, np.zeros((bs - len(starts), S), v.dtype)]) for k, v in batch.items()}
            yield batch

    def bytes_per_token(self, source: str) -> float:
        """UTF-8 bytes of the source's documents per stored token (specials included): bits per byte =
        loss_nats / ln 2 / bytes_per_token."""
        manifest = self.source(source).store.manifest
        return manifest["text_bytes"] / max(manifest["tokens"], 1)

    def source(self, name: str) -> _Source:
        if name not in self._sources:
            if name not in self.paths:
                known = ", ".join(self.paths)
                raise UserError(f"{self.recipe.source}: no data source {name!r} (sources: {known})")
            store = JaggedStore(self.paths[name])
            self._check_store(name, store)
            self._sources[name] = _Source(name, store)
        return self._sources[name]

    def phase_at(self, step: int) -> int:
        return max(i for i, p in enumerate(self.phases) if p.start_step <= step)

    def stretch_at(self, step: int) -> int:
        return max(i for i, s in enumerate(self.stretches) if s[0] <= step)

    def shape(self, step: int) -> tuple[int, int]:
        """(batch_size, seq_len) of `step` under the schedule."""
        _, S, B = self.stretches[self.stretch_at(step)]
        return B, S

    def rows_before(self, step: int) -> int:
        """Global rows of all steps before `step` (the batch size is piecewise constant)."""
        q = self.stretch_at(step)
        start, _, B = self.stretches[q]
        return self._stretch_rows[q] + (step - start) * B

    def sources_of(self, step: int, rows: np.ndarray | None = None) -> list[str]:
        """Which source each row of `step` is drawn from (mixture tests, metrics)."""
        rows = np.arange(self.shape(step)[0]) if rows is None else rows
        p = self.phase_at(step)
        src, _ = self._assign(step, rows)
        return [self.phases[p].sources[i] for i in src]

    # ---------------------------------------------------------------------------------------------
    # Mixture: which source and which of its samples each row gets.

    def _assign(self, step: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index within the phase, k = rows of that source drawn before this one) per row."""
        p = self.phase_at(step)
        phase = self.phases[p]
        g = self.rows_before(step) - self._phase_rows[p] + rows.astype(np.int64)
        block, slot = g // BLOCK_ROWS, g % BLOCK_ROWS
        src = np.empty(len(rows), np.int64)
        k = np.empty(len(rows), np.int64)
        counts = np.asarray(phase.counts, np.int64)
        for j in np.unique(block):
            assign, rank = self._block(p, int(j))
            sel = block == j
            src[sel] = assign[slot[sel]]
            k[sel] = self._consumed[p][src[sel]] + j * counts[src[sel]] + rank[slot[sel]]
        return src, k

    def _block(self, p: int, j: int) -> tuple[np.ndarray, np.ndarray]:
        """Block j of phase p: the source of each slot and its rank among that source's slots."""
        key = (p, j)
        if key not in self._blocks:
            counts = self.phases[p].counts
            assign = np.repeat(np.arange(len(counts)), counts)
            rng = np.random.default_rng([self.seed, 0x6D6978, p, j])  # "mix"
            assign = assign[rng.permutation(BLOCK_ROWS)]
            rank = np.empty(BLOCK_ROWS, np.int64)
            for s in range(len(counts)):
                where = np.flatnonzero(assign == s)
                rank[where] = np.arange(len(where))
            self._blocks[key] = (assign, rank)
            if len(self._blocks) > 16:
                self._blocks.popitem(last=False)
        return self._blocks[key]

    def _used_before_phases(self) -> list[dict[str, int]]:
        """Per phase, rows each source already gave in earlier phases (by name across phases)."""
        used: dict[str, int] = {}
        out = []
        for p, phase in enumerate(self.phases):
            out.append(dict(used))
            if p + 1 == len(self.phases):
                break
            given = self._given_in_phase(p, self._phase_rows[p + 1] - self._phase_rows[p])
            for name, n in zip(phase.sources, given, strict=True):
                used[name] = used.get(name, 0) + int(n)
        return out

    def _given_in_phase(self, p: int, rows: int) -> np.ndarray:
        """Rows each of phase p's sources gives in the phase's first `rows` rows."""
        phase = self.phases[p]
        full, rest = divmod(rows, BLOCK_ROWS)
        given = full * np.asarray(phase.counts, np.int64)
        if rest:  # inside a block: count that block's first `rest` slots
            given += np.bincount(self._block(p, full)[0][:rest], minlength=len(phase.sources))
        return given

    def _source_rows_before(self, row: int) -> dict[str, int]:
        """Rows each source gave among the run's first `row` global rows (closed form)."""
        p = max(i for i, r in enumerate(self._phase_rows) if r <= row)
        out = dict(self._used[p])
        for name, n in zip(self.phases[p].sources, self._given_in_phase(p, row - self._phase_rows[p]), strict=True):
            out[name] = out.get(name, 0) + int(n)
        return out

    def _stretch_offsets(self) -> list[tuple[dict[str, int], dict[str, int]]]:
        """Per stretch of constant seq_len: (K, off) per source: rows given before it, and the window index
        its first row of the source takes (tokens covered before it over the new length, rounded up)."""
        out: list[tuple[dict[str, int], dict[str, int]]] = [({}, {})]
        tokens: dict[str, int] = {}
        for q in range(1, len(self.stretches)):
            before = self._source_rows_before(self._stretch_rows[q - 1])
            at = self._source_rows_before(self._stretch_rows[q])
            S_prev, S = self.stretches[q - 1][1], self.stretches[q][1]
            for name in at:
                tokens[name] = tokens.get(name, 0) + (at[name] - before.get(name, 0)) * S_prev
            out.append((at, {name: -(-t // S) for name, t in tokens.items()}))
        return out

    # ---------------------------------------------------------------------------------------------
    # Packing: windows of a source's token stream → tokens, targets, segment ids, loss mask.

    def _rows(self, step: int, rows: np.ndarray) -> dict[str, np.ndarray]:
        q = self.stretch_at(step)
        S = self.stretches[q][1]
        given, offset = self._offsets[q]
        src_index, k = self._assign(step, rows)
        phase = self.phases[self.phase_at(step)]
        out = {
            "tokens": np.zeros((len(rows), S), np.int32),
            "targets": np.zeros((len(rows), S), np.int32),
            "segment_ids": np.zeros((len(rows), S), np.int32),
            "loss_mask": np.zeros((len(rows), S), np.float32),
        }
        for s in np.unique(src_index):
            sel = np.flatnonzero(src_index == s)
            src = self.source(phase.sources[int(s)])
            index = k[sel] - given.get(src.name, 0) + offset.get(src.name, 0)
            starts = self._window_starts(src, index, S)
            window, valid = src.read(starts, S + 1)
            packed = self._pack(src, starts, window, valid, S)
            for key, value in packed.items():
                out[key][sel] = value
        return out

    def _window_starts(self, src: _Source, k: np.ndarray, seq_len: int | None = None) -> np.ndarray:
        S = seq_len or self.seq_len
        n_windows = src.n_tokens // S - 1  # any shift in [0, S) still leaves S+1 tokens per window
        epoch, index = k // n_windows, k % n_windows
        starts = np.empty(len(k), np.int64)
        for e in np.unique(epoch):
            sel = epoch == e
            key = _mix64(self.seed, src.key, int(e))
            shift = key % S
            starts[sel] = shift + _feistel(index[sel], n_windows, key) * S
        return starts

    def _pack(
        self, src: _Source, starts: np.ndarray, window: np.ndarray, valid: np.ndarray, seq_len: int | None = None
    ) -> dict[str, np.ndarray]:
        """Segment ids from the document offsets: +1 at every document start inside the window."""
        S = seq_len or self.seq_len
        offsets = src.offsets
        first = np.searchsorted(offsets, starts, side="right")  # first document starting after `start`
        last = np.searchsorted(offsets, starts + S, side="right")  # … and at or before start + S
        n_inside = last - first
        row = np.repeat(np.arange(len(starts)), n_inside)
        within = np.arange(n_inside.sum()) - np.repeat(np.cumsum(n_inside) - n_inside, n_inside)
        boundary = offsets[np.repeat(first, n_inside) + within] - starts[row]
        starts_doc = np.zeros((len(starts), S + 1), np.int32)
        np.add.at(starts_doc, (row, boundary), 1)
        doc = np.cumsum(starts_doc, axis=1) + 1
        seg = np.where(valid, doc, 0)
        same = (seg[:, 1:] == seg[:, :-1]) & valid[:, 1:]
        return {
            "tokens": window[:, :S].astype(np.int32),
            "targets": window[:, 1:].astype(np.int32),
            "segment_ids": seg[:, :S].astype(np.int32),
            "loss_mask": same.astype(np.float32),
        }

    def _check_store(self, name: str, store: JaggedStore) -> None:
        tok = store.manifest["tokenizer"]
        want = self.recipe.data.tokenizer
        if want == "byte":
            ok = tok["identity"] == "byte-v1"
        else:
            path = Path(want)
            if not path.is_file():
                raise UserError(f"{self.recipe.source}: data.tokenizer: no such file {want}")
            ok = tok["identity"] == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
        if not ok:
            raise UserError(f"{store.root}: tokenized with {tok['name']!r}, but data.tokenizer is {want!r}")
        if tok["vocab_size"] > self.recipe.model.vocab_size:
            raise UserError(
                f"{store.root}: tokenizer vocab {tok['vocab_size']} exceeds model.vocab_size "
                f"{self.recipe.model.vocab_size}"
            )
        longest = max(S for _, S, _ in self.stretches)
        if store.num_tokens < 2 * longest and any(name in p.sources for p in self.phases):
            raise UserError(f"{store.root}: {store.num_tokens} tokens; source {name!r} needs ≥ 2·seq_len ({longest})")


class Prefetcher:
    """An iterator of batches computed `depth` ahead on a background thread; `close()` stops it."""

    def __init__(self, produce: Iterator[dict[str, np.ndarray]], depth: int):
        self._produce, self._depth = produce, depth
        self._done = object()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._work, name="marinctl-prefetch", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        try:
            for item in self._produce:
                if not self._put(item):
                    return
            self._put(self._done)
        except BaseException as err:  # re-raised in the consumer's thread
            self._put(err)

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        if self._thread is None:
            return next(self._produce)
        item = self._queue.get()
        if item is self._done:
            self._queue.put(item)  # stay exhausted
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stretches(recipe: Recipe) -> list[tuple[int, int, int]]:
    """(first step, seq_len, batch_size) of each stretch of constant shape under the schedule (changes that
    keep the shape, like a transport switch, do not start a stretch: the data cannot see them)."""
    from marinctl.schedule import segments

    out: list[tuple[int, int, int]] = []
    for seg in segments(recipe):
        shape = (seg.recipe.train.seq_len, seg.recipe.train.batch_size)
        if not out or out[-1][1:] != shape:
            out.append((seg.start, *shape))
    return out


def _stretch_rows(stretches: list[tuple[int, int, int]]) -> list[int]:
    rows, out = 0, []
    for q, (start, _, _) in enumerate(stretches):
        if q:
            rows += (start - stretches[q - 1][0]) * stretches[q - 1][2]
        out.append(rows)
    return out


def _phases(recipe: Recipe) -> list[Phase]:
    """Phases with per-block counts (`[[data.phases]]` and data.weights changes); none means equal
    weights over non-eval sources."""
    from marinctl.schedule import mixture_phases

    names = [s.name for s in recipe.data.sources]
    configured = mixture_phases(recipe)
    if not configured:
        train = [n for n in names if n not in recipe.eval.sources]
        if not train:
            raise UserError(f"{recipe.source}: every data source is an eval source; nothing to train on")
        configured = [(0, dict.fromkeys(train, 1.0))]
    phases = []
    for start, weights in configured:
        chosen = [n for n in names if weights.get(n, 0) > 0]
        w = np.array([weights[n] for n in chosen], np.float64)
        phases.append(Phase(start, tuple(chosen), _largest_remainder(w / w.sum(), BLOCK_ROWS)))
    return phases


def _largest_remainder(fractions: np.ndarray, total: int) -> tuple[int, ...]:
    raw = fractions * total
    counts = np.floor(raw).astype(np.int64)
    order = np.argsort(-(raw - counts), kind="stable")
    counts[order[: total - counts.sum()]] += 1
    return tuple(int(c) for c in counts)


def _mix64(*values: int) -> int:
    data = b"".join(int(v).to_bytes(8, "little", signed=False) for v in values)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
    return x ^ (x >> np.uint64(31))


def _feistel(index: np.ndarray, n: int, key: int, rounds: int = 4) -> np.ndarray:
    """A keyed bijection of [0, n): a balanced Feistel network on 2h bits, cycle-walked back into range.
    O(1) per element, so epoch permutations of billions of windows cost nothing to "materialize"."""
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = [np.uint64(_mix64(key, r)) for r in range(rounds)]

    def permute(x: np.ndarray) -> np.ndarray:
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_splitmix64(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    x = permute(index.astype(np.uint64))
    while (out := x >= np.uint64(n)).any():  # cycle walking: stays a bijection on [0, n)
        x[out] = permute(x[out])
    return x.astype(np.int64)
