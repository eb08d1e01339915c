"""`marinctl tokenize`: the JSON contract, documented outcomes for hostile inputs, and the SIGKILL test."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from marinctl.cli import run
from marinctl.data.ingest import COMMIT_SLEEP_ENV
from marinctl.data.store import JaggedStore, read_manifest
from marinctl.data.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]


def tokenize(capsys, *args):
    code = run(["tokenize", *map(str, args), "--json", "--quiet"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


@pytest.fixture
def hostile(tmp_path):
    """One of each kind of hostile input, named so that sorted order puts the binary file first."""
    d = tmp_path / "in"
    d.mkdir()
    (d / "a_blob.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 4)
    (d / "b_docs.jsonl").write_text('{"text": "ok"}\n{"text": ""}\n\n{"text": null}\n{"text": "also ok"}\n')
    (d / "c_empty.txt").write_text("")
    (d / "d_spaces.txt").write_text("  \n\t ")
    (d / "e_latin1.txt").write_bytes("café crème".encode("latin-1"))
    (d / "f_good.txt").write_text("good text")
    lines = b"".join(json.dumps({"text": f"line {i}"}).encode() + b"\n" for i in range(20000))
    (d / "g_trunc.jsonl.gz").write_bytes(gzip.compress(lines)[:20000])
    return d


def test_bad_file_without_skip_exits_2_with_one_line_naming_it(capsys, hostile, tmp_path):
    code, out, err = tokenize(capsys, hostile, "--out", tmp_path / "s")
    lines = [line for line in err.splitlines() if "warning: stage" not in line]
    assert code == 2 and out is None
    assert lines == [
        f"{hostile / 'a_blob.bin'}: binary file (NUL bytes), not text (pass --skip-bad-files to skip such files)"
    ]


def test_hostile_inputs_give_the_documented_counts_with_skip_bad_files(capsys, hostile, tmp_path):
    code, out, _ = tokenize(capsys, hostile, "--out", tmp_path / "s", "--skip-bad-files")
    assert code == 0
    manifest = read_manifest(tmp_path / "s")
    trunc_docs = manifest["inputs"][-1]["documents"]
    assert 0 < trunc_docs < 20000  # records before the truncation point are kept
    # ok, also ok (jsonl) + latin1 (replaced) + good + the readable part of the truncated .gz
    assert out["documents"] == 4 + trunc_docs
    assert out["skipped_empty"] == 3 + 2  # "", blank line, null; the empty and the whitespace-only file
    assert out["invalid_utf8"] == 1 and out["skipped_files"] == 2
    assert [(b["path"].split("/")[-1], b["error"].split(" (")[0]) for b in out["bad_files"]] == [
        ("a_blob.bin", "binary file"),
        ("g_trunc.jsonl.gz", "truncated or corrupt gzip data"),
    ]
    for key in ("documents", "tokens", "skipped_empty", "invalid_utf8", "skipped_files", "store"):
        assert key in out
    store, tok = JaggedStore(tmp_path / "s"), load_tokenizer("byte")
    assert [tok.decode(store.document(i)) for i in range(4)] == ["ok", "also ok", "caf\ufffd cr\ufffdme", "good text"]
    assert tok.decode(store.document(4 + trunc_docs - 1)) == f"line {trunc_docs - 1}"


def test_invalid_utf8_skip_policy_drops_the_document_but_still_counts_it(capsys, hostile, tmp_path):
    _, out, _ = tokenize(capsys, hostile, "--out", tmp_path / "s", "--skip-bad-files", "--invalid-utf8", "skip")
    _, replaced, _ = tokenize(capsys, hostile, "--out", tmp_path / "r", "--skip-bad-files")
    assert out["invalid_utf8"] == 1 and out["documents"] == replaced["documents"] - 1


def test_user_mistakes_exit_2(capsys, tmp_path):
    (tmp_path / "x.txt").write_text("x")
    assert tokenize(capsys, tmp_path / "missing", "--out", tmp_path / "s")[0] == 2
    assert tokenize(capsys, tmp_path / "x.txt", "--out", tmp_path / "s", "--invalid-utf8", "drop")[0] == 2
    assert tokenize(capsys, tmp_path / "x.txt", "--out", tmp_path / "s", "--tokenizer", tmp_path / "no.json")[0] == 2
    assert tokenize(capsys, tmp_path / "x.txt", "--out", tmp_path)[0] == 2  # not a store: never overwritten


def test_train_tokenizer_saves_it_beside_the_store_and_round_trips(capsys, tmp_path):
    docs = [f"document {i}: the quick brown fox jumps over the lazy dog {i * i}" for i in range(200)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    code, out, _ = tokenize(capsys, tmp_path / "d.jsonl", "--out", tmp_path / "s", "--train-tokenizer", "300")
    assert code == 0 and out["vocab_size"] == 300 and (tmp_path / "s" / "tokenizer.json").is_file()
    tok, store = load_tokenizer(tmp_path / "s" / "tokenizer.json"), JaggedStore(tmp_path / "s")
    assert [tok.decode(store.document(i)) for i in range(store.documents)] == docs
    assert out["tokens"] < sum(len(d) for d in docs)  # BPE, not bytes
    again = tokenize(capsys, tmp_path / "d.jsonl", "--out", tmp_path / "s", "--train-tokenizer", "300")[1]
    assert again["added_documents"] == 0  # rerun reuses the saved tokenizer and finds the store complete


def test_sigkill_mid_run_then_rerun_equals_an_uninterrupted_run(capsys, tmp_path):
    rng = np.random.default_rng(0)
    words = np.array(["alpha", "beta", "gamma", "δέλτα", "epsilon", "zeta\n"])
    with open(tmp_path / "corpus.jsonl", "w") as f:
        for _ in range(6000):
            f.write(json.dumps({"text": " ".join(rng.choice(words, rng.integers(5, 40)))}) + "\n")
    args = [tmp_path / "corpus.jsonl", "--commit-tokens", "20000"]
    assert tokenize(capsys, *args, "--out", tmp_path / "clean")[0] == 0

    killed = tmp_path / "killed"
    env = dict(os.environ, **{COMMIT_SLEEP_ENV: "0.1"})
    cmd = [sys.executable, "-m", "marinctl.cli", "tokenize", *map(str, args), "--out", str(killed), "-q"]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        manifest = read_manifest(killed) if (killed / "manifest.json").exists() else None
        if manifest and manifest["documents"] > 0:
            break
        time.sleep(0.02)
    time.sleep(0.15)  # land inside a later commit's window (data written, manifest not yet)
    assert proc.poll() is None, "tokenize finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    interrupted = read_manifest(killed)
    assert not interrupted["complete"] and 0 < interrupted["documents"] < 6000

    code, out, _ = tokenize(capsys, *args, "--out", killed)
    assert code == 0 and out["resumed"] and out["added_documents"] == 6000 - interrupted["documents"]
    a, b = JaggedStore(tmp_path / "clean"), JaggedStore(killed)
    assert np.array_equal(a.read_tokens(), b.read_tokens()) and np.array_equal(a.offsets, b.offsets)
    drop = ("run",)
    assert {k: v for k, v in a.manifest.items() if k not in drop} == {
        k: v for k, v in b.manifest.items() if k not in drop
    }
