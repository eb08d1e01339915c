"""The jagged store: plain-zarr readable, ~1 MB chunks, and a commit protocol that survives a crash."""

import json

import numpy as np
import pytest
import zarr

from marinctl.data import store as store_mod
from marinctl.data.store import CHUNK_BYTES, JaggedStore, StoreWriter, read_manifest, remove_store, write_manifest
from marinctl.errors import UserError


def manifest_for(writer, complete=False):
    return {
        "format": store_mod.FORMAT,
        "complete": complete,
        "documents": writer.documents,
        "tokens": writer.tokens,
        "tokenizer": {"vocab_size": 300},
        "dtype": "uint16",
    }


def write_docs(writer, docs):
    for doc in docs:
        writer.begin_document(None)
        writer.append(np.asarray(doc, np.int64))
        writer.end_document(None)


DOCS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
FLAT = [t for doc in DOCS for t in doc]


def test_store_is_a_zarr_v3_group_with_1mb_chunks_readable_by_plain_zarr(tmp_path):
    writer = StoreWriter.create(tmp_path / "s", np.dtype(np.uint16))
    write_docs(writer, DOCS)
    writer.finish(manifest_for(writer, complete=True))
    group = zarr.open_group(tmp_path / "s", mode="r")
    tokens, offsets = group["tokens"], group["offsets"]
    assert tokens.dtype == np.uint16 and offsets.dtype == np.int64
    assert tokens.chunks[0] * tokens.dtype.itemsize == CHUNK_BYTES == offsets.chunks[0] * 8
    assert tokens[:].tolist() == FLAT and offsets[:].tolist() == [0, 3, 4, 9, 11]
    opened = JaggedStore(tmp_path / "s")
    assert [opened.document(i).tolist() for i in range(4)] == DOCS


def test_uncommitted_data_from_a_crash_is_dropped_when_reopened(tmp_path):
    root = tmp_path / "s"
    writer = StoreWriter.create(root, np.dtype(np.uint16))
    write_docs(writer, DOCS[:2])
    writer.commit(manifest_for(writer))
    write_docs(writer, [[99] * 50, [98] * 7])
    writer._flush()  # data on disk past the commit, as if killed before the manifest was written
    group = zarr.open_group(root, mode="r")
    assert group["tokens"].shape[0] == 4 + 57  # the crash left uncommitted tokens in the array …
    committed = read_manifest(root)
    resumed = StoreWriter.resume(root, committed["documents"], committed["tokens"])  # … which resume drops
    write_docs(resumed, DOCS[2:])
    resumed.finish(manifest_for(resumed, complete=True))
    group = zarr.open_group(root, mode="r")
    assert group["tokens"][:].tolist() == FLAT and group["offsets"][:].tolist() == [0, 3, 4, 9, 11]


def test_aborted_document_leaves_no_tokens_even_after_a_mid_document_flush(tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod, "_FLUSH_TOKENS", 4)  # a long document spills to disk before it ends
    writer = StoreWriter.create(tmp_path / "s", np.dtype(np.uint16))
    write_docs(writer, DOCS[:1])
    writer.begin_document(None)
    writer.append(np.arange(100, 110))
    writer.abort_document()
    writer.begin_document(None)
    writer.append(np.array([42]))
    writer.append(np.arange(20, 30))  # flushed mid-document, then abandoned
    writer.abort_document()
    write_docs(writer, DOCS[1:])
    writer.finish(manifest_for(writer, complete=True))
    opened = JaggedStore(tmp_path / "s")
    assert opened.read_tokens().tolist() == FLAT and opened.documents == 4


def test_manifest_write_is_atomic_and_incomplete_stores_are_refused_for_reading(tmp_path):
    root = tmp_path / "s"
    writer = StoreWriter.create(root, np.dtype(np.uint16))
    write_docs(writer, DOCS)
    writer.commit(manifest_for(writer))
    assert not (root / "manifest.json.tmp").exists()
    assert json.loads((root / "manifest.json").read_text())["documents"] == 4
    with pytest.raises(UserError, match="incomplete"):
        JaggedStore(root)
    with pytest.raises(UserError, match="no token store here"):
        JaggedStore(tmp_path / "nothing")


def test_remove_store_refuses_a_folder_that_is_not_a_store(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("precious")
    with pytest.raises(UserError, match="not a marinctl token store"):
        remove_store(tmp_path / "mine")
    assert (tmp_path / "mine" / "thesis.tex").exists()
    write_manifest(tmp_path / "mine", {"format": store_mod.FORMAT})  # manifest makes it a store
    remove_store(tmp_path / "mine")
    assert (tmp_path / "mine" / "thesis.tex").exists() and not (tmp_path / "mine" / "manifest.json").exists()
