"""The tokenize pipeline: lossless round trips, resume/append semantics, bad-input policy, bounded memory."""

import json
import time
import tracemalloc

import numpy as np
import pytest

from marinctl.data.ingest import IngestOptions, ingest
from marinctl.data.readers import MemoryInput, discover_inputs
from marinctl.data.store import JaggedStore
from marinctl.data.tokenizer import ByteTokenizer, load_tokenizer, train_tokenizer
from marinctl.errors import UserError

BYTE = ByteTokenizer()


def corpus(tmp_path, n_files=3):
    rng = np.random.default_rng(0)
    docs = []
    for i in range(n_files):
        file_docs = ["".join(rng.choice(list("abcdefgh ijk\nüλ"), rng.integers(1, 300))) for _ in range(40)]
        (tmp_path / f"f{i}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in file_docs))
        docs += file_docs
    return docs


def stored_documents(root, tok=BYTE):
    store = JaggedStore(root)
    return [tok.decode(store.document(i)) for i in range(store.documents)], store


def test_byte_tokenization_decodes_back_to_exactly_the_input_documents(tmp_path):
    docs = corpus(tmp_path)
    out = ingest(tmp_path / "s", discover_inputs([tmp_path]), BYTE)
    got, store = stored_documents(tmp_path / "s")
    kept = [d for d in docs if d.strip()]
    assert got == kept and out["documents"] == len(kept) and out["skipped_empty"] == len(docs) - len(kept)
    assert store.num_tokens == sum(len(d.encode()) + 2 for d in kept)  # each document is <bos> … <eos>
    assert all(store.document(i)[0] == 256 and store.document(i)[-1] == 257 for i in range(3))
    assert out["text_bytes"] == sum(len(d.encode()) for d in kept)


def test_trained_tokenizer_store_round_trips_its_documents(tmp_path):
    docs = corpus(tmp_path, n_files=1)
    inputs = discover_inputs([tmp_path])
    tok = train_tokenizer((d for d in docs), 300, tmp_path / "tok" / "tokenizer.json")
    ingest(tmp_path / "s", inputs, tok)
    got, _ = stored_documents(tmp_path / "s", load_tokenizer(tmp_path / "tok" / "tokenizer.json"))
    assert got == [d for d in docs if d.strip()]


def test_commit_boundaries_do_not_change_the_stored_tokens(tmp_path):
    corpus(tmp_path)
    inputs = discover_inputs([tmp_path])
    ingest(tmp_path / "a", inputs, BYTE, IngestOptions(commit_tokens=3000))
    ingest(tmp_path / "b", inputs, BYTE)
    a, b = JaggedStore(tmp_path / "a"), JaggedStore(tmp_path / "b")
    assert np.array_equal(a.read_tokens(), b.read_tokens()) and np.array_equal(a.offsets, b.offsets)


def test_rerun_is_a_no_op_and_a_longer_input_list_appends(tmp_path):
    docs = corpus(tmp_path)
    files = discover_inputs([tmp_path])
    ingest(tmp_path / "s", files[:2], BYTE)
    again = ingest(tmp_path / "s", files[:2], BYTE)
    assert again["added_documents"] == 0 and not again["resumed"]
    more = ingest(tmp_path / "s", files, BYTE)
    got, _ = stored_documents(tmp_path / "s")
    assert got == [d for d in docs if d.strip()] and more["added_documents"] == len(got) - again["documents"]


def test_changed_inputs_or_tokenizer_are_refused_instead_of_mixed(tmp_path):
    corpus(tmp_path)
    files = discover_inputs([tmp_path])
    ingest(tmp_path / "s", files, BYTE)
    (tmp_path / "f0.jsonl").write_text('{"text": "edited"}\n')
    with pytest.raises(UserError, match=r"f0\.jsonl changed"):
        ingest(tmp_path / "s", discover_inputs([tmp_path]), BYTE)
    with pytest.raises(UserError, match="store was made with tokenizer"):
        tok = train_tokenizer(iter(["abc"]), 300, tmp_path / "t" / "tokenizer.json")
        ingest(tmp_path / "s", files, tok)
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="is not a marinctl token store"):
        ingest(tmp_path / "user", files, BYTE)


def test_invalid_utf8_is_replaced_or_skipped_and_counted(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_bytes(b"ok \xff\xfe bytes")
    (tmp_path / "in" / "b.txt").write_text("clean")
    files = discover_inputs([tmp_path / "in"])
    replaced = ingest(tmp_path / "r", files, BYTE)
    skipped = ingest(tmp_path / "k", files, BYTE, IngestOptions(invalid_utf8="skip"))
    assert (replaced["documents"], replaced["invalid_utf8"]) == (2, 1)
    assert stored_documents(tmp_path / "r")[0] == ["ok \ufffd\ufffd bytes", "clean"]
    assert (skipped["documents"], skipped["invalid_utf8"]) == (1, 1)
    assert stored_documents(tmp_path / "k")[0] == ["clean"]


def test_memory_inputs_round_trip(tmp_path):
    docs = ("alpha", "  ", "beta gamma")
    out = ingest(tmp_path / "s", [MemoryInput("mem", docs)], BYTE)
    assert stored_documents(tmp_path / "s")[0] == ["alpha", "beta gamma"] and out["skipped_empty"] == 1


def test_fifty_megabyte_single_line_streams_in_bounded_memory(tmp_path):
    line = np.random.default_rng(0).integers(97, 123, 50 << 20, dtype=np.uint8)
    line[::7] = 32  # words
    path = tmp_path / "huge.txt"
    path.write_bytes(line.tobytes())
    started = time.perf_counter()
    tracemalloc.start()
    out = ingest(tmp_path / "s", discover_inputs([path]), BYTE)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # Whole-document processing would hold ≥ 50 MB of bytes + 50 MB of str + 200 MB of int32 ids.
    assert peak < 64 << 20, f"peak traced memory {peak / 2**20:.0f} MiB"
    assert out["documents"] == 1 and out["tokens"] == len(line) + 2
    tokens = JaggedStore(tmp_path / "s").read_tokens()
    assert tokens[0] == 256 and tokens[-1] == 257 and np.array_equal(tokens[1:-1], line)
    assert time.perf_counter() - started < 20
