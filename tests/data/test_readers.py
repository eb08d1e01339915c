"""Readers: every input format yields the same documents, in bounded pieces, with hostile input flagged."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from marinctl.data import readers
from marinctl.data.readers import BadFile, InputFile, Reader, discover_inputs
from marinctl.errors import UserError

DOCS = ["first document", "zweites Dokument — ü", "", "third\nwith a newline", "日本語"]


def documents(path, skip=0, text_field="text"):
    """Join pieces back into documents (the oracle for piece boundaries is the input itself)."""
    (file,) = discover_inputs([path])
    out, current = [], []
    for piece in Reader(file, text_field=text_field).pieces(skip):
        current.append(piece.text)
        if piece.last:
            out.append("".join(current))
            current = []
    return out


def write_jsonl(path, docs, opener=open):
    with opener(path, "wb") as f:
        for d in docs:
            f.write((json.dumps({"text": d, "id": 1}) + "\n").encode())


@pytest.mark.parametrize(
    "name,opener",
    [
        ("d.jsonl", open),
        ("d.jsonl.gz", gzip.open),
        ("d.jsonl.zst", lambda p, m: zstandard.open(p, m)),
    ],
)
def test_jsonl_plain_gzip_and_zstd_yield_one_document_per_line(tmp_path, name, opener):
    write_jsonl(tmp_path / name, DOCS, opener)
    assert documents(tmp_path / name) == DOCS
    assert documents(tmp_path / name, skip=2) == DOCS[2:]  # resume skips whole records


def test_parquet_rows_are_documents_and_null_is_empty(tmp_path):
    table = pa.table({"content": [*DOCS, None], "n": list(range(len(DOCS) + 1))})
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)
    assert documents(tmp_path / "d.parquet", text_field="content") == [*DOCS, ""]
    for skip in range(len(DOCS) + 2):  # resume at any row, inside or at the edge of a row group
        assert documents(tmp_path / "d.parquet", skip=skip, text_field="content") == [*DOCS, ""][skip:]
    with pytest.raises(BadFile, match="no column 'text'"):
        documents(tmp_path / "d.parquet")


def test_text_file_is_one_document_streamed_in_pieces_that_never_split_a_character(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "PIECE_BYTES", 1000)
    monkeypatch.setattr(readers, "_WHITESPACE_LOOKBACK", 100)
    line = ("wörd " * 150 + "€" * 700) * 3  # 9000 bytes: whitespace runs, then 2100-byte runs of 3-byte chars
    (tmp_path / "long.txt").write_text(line, encoding="utf-8")
    (file,) = discover_inputs([tmp_path / "long.txt"])
    pieces = list(Reader(file).pieces())
    assert "".join(p.text for p in pieces) == line
    assert [p.last for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert all(p.nbytes == len(p.text.encode()) <= 1000 for p in pieces) and len(pieces) >= 9
    assert any(p.nbytes < 1000 and p.text.endswith("€") for p in pieces[:-1])  # a cut backed off a character
    assert not any(p.invalid_utf8 for p in pieces)


def test_split_text_cuts_long_json_strings_the_same_way(monkeypatch):
    monkeypatch.setattr(readers, "PIECE_BYTES", 64)
    text = "lorem ipsum dolor " * 40
    pieces = list(readers._split_text(text))
    assert "".join(p.text for p in pieces) == text and all(len(p.text) <= 64 for p in pieces)
    assert all(p.text.startswith(" ") for p in pieces[1:])  # cut before whitespace, not inside words


def test_invalid_utf8_and_lone_surrogates_are_replaced_and_flagged(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    (piece,) = Reader(discover_inputs([tmp_path / "latin1.txt"])[0]).pieces()
    assert piece.text == "caf\ufffd" and piece.invalid_utf8
    (tmp_path / "s.jsonl").write_text('{"text": "a\\ud800b"}\n{"text": "fine"}\n')
    got = list(Reader(discover_inputs([tmp_path / "s.jsonl"])[0]).pieces())
    assert [(p.text, p.invalid_utf8) for p in got] == [("a\ufffdb", True), ("fine", False)]


def test_hostile_files_raise_bad_file_with_the_reason(tmp_path):
    data = b"".join(json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(5000))
    (tmp_path / "trunc.jsonl.gz").write_bytes(gzip.compress(data)[:3000])
    (tmp_path / "trunc.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data)[:3000])
    (tmp_path / "blob.bin").write_bytes(bytes(range(256)) * 10)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"text": oops}\n')
    (tmp_path / "field.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "type.jsonl").write_text('{"text": 3}\n')
    (tmp_path / "not.parquet").write_bytes(b"PAR1 this is not parquet")
    expect = {
        "trunc.jsonl.gz": "truncated or corrupt gzip",
        "trunc.jsonl.zst": "truncated or corrupt zstd",
        "blob.bin": "binary file",
        "bad.jsonl": "line 2: invalid JSON",
        "field.jsonl": "line 1: no field 'text'",
        "type.jsonl": "line 1: field 'text' is int",
        "not.parquet": "not a readable Parquet file",
    }
    for name, reason in expect.items():
        with pytest.raises(BadFile, match=reason) as err:
            list(Reader(discover_inputs([tmp_path / name])[0]).pieces())
        assert "\n" not in str(err.value)


def test_truncated_stream_keeps_the_records_before_the_error(tmp_path):
    data = b"".join(json.dumps({"text": f"doc {i}"}).encode() + b"\n" for i in range(40000))  # > 1 zstd block
    (tmp_path / "t.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data)[:-50])
    reader = Reader(discover_inputs([tmp_path / "t.jsonl.zst"])[0])
    got = []
    with pytest.raises(BadFile):
        for piece in reader.pieces():
            got.append(piece.text)
    assert got == [f"doc {i}" for i in range(len(got))] and 0 < len(got) < 40000


def test_folders_are_walked_recursively_sorted_skipping_hidden_entries(tmp_path):
    for rel in ["b/z.txt", "b/a.jsonl.gz", "a.parquet", ".hidden/x.txt", "c/.dot.txt", "c/d.zst"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"x")
    found = discover_inputs([tmp_path, tmp_path / "b" / "z.txt"])  # a repeated file counts once
    rel = [f.path.relative_to(tmp_path.resolve()).as_posix() for f in found]
    assert rel == ["a.parquet", "b/a.jsonl.gz", "b/z.txt", "c/d.zst"]
    assert [(f.kind, f.compression) for f in found] == [
        ("parquet", ""),
        ("jsonl", "gzip"),
        ("text", ""),
        ("text", "zstd"),
    ]
    with pytest.raises(UserError, match="no such file or directory"):
        discover_inputs([tmp_path / "missing"])
    assert isinstance(found[0], InputFile)
