"""The loader: packing with segment ids, phased mixtures, and batches that are a pure function of the step."""

from dataclasses import replace

import numpy as np
import pytest

from marinctl.data.builtin import ensure_builtin_corpus
from marinctl.data.ingest import ingest
from marinctl.data.loader import BLOCK_ROWS, Loader, _feistel
from marinctl.data.readers import MemoryInput
from marinctl.data.store import JaggedStore
from marinctl.data.tokenizer import ByteTokenizer
from marinctl.errors import UserError
from marinctl.recipe import PhaseConfig, SourceConfig

BOS = 256
S, B, SWITCH = 32, 16, 120
LETTERS = {"a": "abcdefghijklm", "b": "nopqrstuvwxyz", "c": "ABCDEFGHIJKLM"}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Three sources whose letters tell them apart (the oracle for which source a row came from)."""
    root = tmp_path_factory.mktemp("stores")
    rng = np.random.default_rng(0)
    for name, letters in LETTERS.items():
        docs = tuple("".join(rng.choice(list(letters), rng.integers(1, 120))) for _ in range(300))
        ingest(root / name, [MemoryInput(name, docs)], ByteTokenizer())
    return root


def make_recipe(tiny_recipe, root, phases=None, **train):
    phases = phases or (
        PhaseConfig(start_step=0, weights={"a": 0.5, "b": 0.5}),
        PhaseConfig(start_step=SWITCH, weights={"a": 0.8, "b": 0.2}),
    )
    data = replace(
        tiny_recipe.data,
        root=str(root),
        sources=tuple(SourceConfig(n, n) for n in LETTERS),
        phases=phases,
        seed=3,
        prefetch=2,
    )
    train_cfg = replace(tiny_recipe.train, **({"seq_len": S, "batch_size": B, "steps": 200} | train))
    schedule = replace(tiny_recipe.schedule, changes=())  # tiny's context extension: tests/schedule
    return replace(tiny_recipe, data=data, train=train_cfg, eval=replace(tiny_recipe.eval, sources=("c",)),
                   schedule=schedule)  # fmt: skip


@pytest.fixture(scope="module")
def loader(tiny_recipe, root):
    return Loader(make_recipe(tiny_recipe, root))


def same(x, y):
    return x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)


def test_batch_has_the_interface_shapes_and_dtypes(loader):
    batch = loader.batch(0)
    assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
        "tokens": ((B, S), "int32"),
        "targets": ((B, S), "int32"),
        "segment_ids": ((B, S), "int32"),
        "loss_mask": ((B, S), "float32"),
    }


@pytest.mark.parametrize("step", [0, 7, SWITCH - 1, SWITCH, 199])
def test_batch_is_identical_for_one_and_four_hosts(loader, step):
    hosts = [loader.host_batch(step, i, 4) for i in range(4)]
    assert same(loader.batch(step), {k: np.concatenate([h[k] for h in hosts]) for k in hosts[0]})


def test_a_new_loader_at_step_n_reproduces_the_uninterrupted_batches(tiny_recipe, root, loader):
    uninterrupted = [loader.batch(s) for s in range(110, 130)]  # crosses the phase switch
    resumed = Loader(make_recipe(tiny_recipe, root))
    for step in (125, 110, 129, 118):  # any order: nothing depends on history
        assert same(resumed.batch(step), uninterrupted[step - 110])
    assert not same(loader.batch(0), loader.batch(1))


def test_segment_ids_change_exactly_at_document_starts_and_no_target_crosses_documents(loader, root):
    streams = {n: JaggedStore(root / n).read_tokens().astype(np.uint16).tobytes() for n in LETTERS}
    for step in (0, 1, 150):
        batch = loader.batch(step)
        tok, tgt, seg, mask = (batch[k] for k in ("tokens", "targets", "segment_ids", "loss_mask"))
        assert np.array_equal(tgt[:, :-1], tok[:, 1:])
        assert (seg[:, 0] == 1).all()
        # Oracle: every document is <bos> … <eos> and <bos> occurs nowhere else.
        assert np.array_equal(np.diff(seg, axis=1) == 1, tok[:, 1:] == BOS) and (np.diff(seg, axis=1) >= 0).all()
        assert np.array_equal(mask == 0, tgt == BOS)
        for row_tokens, row_targets in zip(tok, tgt, strict=True):  # each row is a contiguous source slice
            window = np.append(row_tokens, row_targets[-1]).astype(np.uint16).tobytes()
            assert any(streams[n].find(window) % 2 == 0 for n in LETTERS if streams[n].find(window) >= 0)


def row_source(tokens):
    letters = tokens[(tokens >= 65) & (tokens < 256)]
    return "a" if letters[0] in map(ord, LETTERS["a"]) else "b" if letters[0] in map(ord, LETTERS["b"]) else "c"


def test_phase_switch_proportions_match_the_weights(loader):
    before = [row_source(r) for s in range(SWITCH) for r in loader.batch(s)["tokens"]]
    after = [row_source(r) for s in range(SWITCH, 200) for r in loader.batch(s)["tokens"]]
    assert "c" not in before + after  # the eval source has no training weight
    for rows, want in ((before, 0.5), (after, 0.8)):
        share = rows.count("a") / len(rows)
        assert abs(share - want) < 3 * np.sqrt(want * (1 - want) / len(rows)), (share, want)
    assert [row_source(r) for r in loader.batch(150)["tokens"]] == loader.sources_of(150)


def test_an_epoch_visits_every_window_once_in_a_fresh_order(loader):
    src = loader.source("a")
    n_windows = src.n_tokens // S - 1
    first = loader._window_starts(src, np.arange(n_windows))
    second = loader._window_starts(src, np.arange(n_windows, 2 * n_windows))
    for starts in (first, second):  # starts = shift + w·S, one shift per epoch, each w once
        assert len(set(starts % S)) == 1 and sorted(starts // S) == list(range(n_windows))
    assert not np.array_equal(first // S, second // S)
    assert (second + S + 1 <= src.n_tokens).all() and (first >= 0).all()


@pytest.mark.parametrize("n", [1, 2, 3, 17, 1000, 12345])
def test_feistel_permutation_is_a_bijection(n):
    assert sorted(_feistel(np.arange(n), n, key=42).tolist()) == list(range(n))


def test_eval_batches_score_every_within_document_target_exactly_once(loader, root):
    stream = JaggedStore(root / "c").read_tokens().astype(np.int64)
    batches = list(loader.eval_batches("c", n_batches=10_000, batch_size=8))
    assert all(same(a, b) for a, b in zip(batches, loader.eval_batches("c", 10_000, 8), strict=True))
    scored = np.concatenate([b["targets"][b["loss_mask"] == 1] for b in batches])
    expected = stream[1:][stream[1:] != BOS]  # every next token except a new document's <bos>
    assert np.array_equal(scored, expected)
    last = batches[-1]
    assert ((last["segment_ids"] == 0) <= (last["loss_mask"] == 0)).all() and (last["segment_ids"] == 0).any()
    assert len(list(loader.eval_batches("c", n_batches=2, batch_size=8))) == 2
    manifest = JaggedStore(root / "c").manifest
    assert loader.bytes_per_token("c") == manifest["text_bytes"] / manifest["tokens"]


def test_prefetching_iterator_yields_the_batch_of_each_step(loader):
    with loader.iterate(195) as it:
        got = list(it)
    assert len(got) == 5 and all(same(g, loader.batch(195 + i)) for i, g in enumerate(got))
    with loader.iterate(10, 14, process_index=1, process_count=2) as it:
        assert all(same(g, loader.host_batch(10 + i, 1, 2)) for i, g in enumerate(it))


def test_block_counts_honour_weights_exactly(loader):
    counts = [p.counts for p in loader.phases]
    assert counts == [(BLOCK_ROWS // 2, BLOCK_ROWS // 2), (1638, 410)] and all(sum(c) == BLOCK_ROWS for c in counts)


def test_bad_configurations_are_one_line_user_errors(tiny_recipe, root, tmp_path):
    recipe = make_recipe(tiny_recipe, root)
    with pytest.raises(UserError, match="no token store here"):
        Loader(recipe, root=tmp_path)
    with pytest.raises(UserError, match="tokenized with 'byte'"):
        Loader(replace(recipe, data=replace(recipe.data, tokenizer=str(root / "a" / "manifest.json"))))
    small_vocab = replace(recipe, model=replace(recipe.model, vocab_size=200))
    with pytest.raises(UserError, match=r"exceeds model\.vocab_size"):
        Loader(small_vocab)
    with pytest.raises(UserError, match="does not split over 3 hosts"):
        Loader(recipe).host_batch(0, 0, 3)


def test_tiny_recipe_trains_from_the_builtin_corpus(tiny_recipe, tmp_path):
    ensure_builtin_corpus(tiny_recipe, root=tmp_path)
    loader = Loader(tiny_recipe, root=tmp_path)
    batch = loader.batch(0)
    assert batch["tokens"].shape == (tiny_recipe.train.batch_size, tiny_recipe.train.seq_len)
    assert batch["tokens"].max() < tiny_recipe.model.vocab_size
    evals = {s: list(loader.eval_batches(s, tiny_recipe.eval.batches)) for s in tiny_recipe.eval.sources}
    assert all(len(v) == tiny_recipe.eval.batches for v in evals.values())


def test_large_sources_read_per_window_give_the_same_batches(tiny_recipe, root, loader, monkeypatch):
    from marinctl.data import loader as loader_mod

    monkeypatch.setattr(loader_mod, "_IN_MEMORY_BYTES", 0)  # as if every source were larger than memory
    windowed = Loader(make_recipe(tiny_recipe, root))
    assert windowed.source("a").tokens is None
    assert all(same(windowed.batch(s), loader.batch(s)) for s in (0, 150))
    tail = zip(windowed.eval_batches("c", 10_000, 8), loader.eval_batches("c", 10_000, 8), strict=True)
    assert all(same(a, b) for a, b in tail)
