"""The tokenized store (docs/recipe.md §6): one jagged array per source — flat `tokens` plus document `offsets`.

Layout of a store directory (a zarr v3 group, readable by plain `zarr.open_group(path)`):

    zarr.json        group metadata
    tokens/          1-D uint16 (vocab ≤ 65,536) or uint32, ~1 MiB chunks, zstd
    offsets/         1-D int64, length documents + 1; document i is tokens[offsets[i]:offsets[i+1]]
    manifest.json    tokenizer identity and hash, vocab size, inputs (sizes, sha256), counts, cursor
    tokenizer.json   only when the tokenizer was trained on the inputs

Crash safety: `manifest.json` is the commit record. A commit writes token and offset data first (through
tensorstore, whose file store replaces each chunk atomically) and then atomically renames a new manifest
into place, so a killed writer leaves the last committed state valid: arrays may hold uncommitted data
past the manifest's counts (a plain zarr reader sees it in `shape` until the next run), and reopening for
append truncates them to the committed counts before writing anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from marinctl.errors import UserError

FORMAT = "marinctl.jagged/1"
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"  # a tokenizer trained on the inputs lives beside the arrays
CHUNK_BYTES = 1 << 20  # docs/recipe.md §6: ~1 MB chunks
_FLUSH_TOKENS = 1 << 21  # pending tokens buffered in memory before they are written (uncommitted)
_OWN_ENTRIES = ("zarr.json", "tokens", "offsets", MANIFEST, MANIFEST + ".tmp", TOKENIZER_FILE, TOKENIZER_FILE + ".tmp")


def read_manifest(root: Path) -> dict | None:
    path = Path(root) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise UserError(f"{path}: unreadable store manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"{path}: not a marinctl token store manifest (format {manifest.get('format')!r})")
    return manifest


def manifest_hash(root: Path) -> str | None:
    """SHA-256 of what a store holds (its manifest without the `run` provenance block: inputs and their
    sha256, tokenizer, counts), or None when there is no store. A checkpoint records it per source, so a
    store rewritten under a run is caught at resume instead of silently feeding different batches."""
    manifest = read_manifest(root)
    if manifest is None:
        return None
    content = {k: v for k, v in manifest.items() if k != "run"}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def write_manifest(root: Path, manifest: dict) -> None:
    """Atomic replace with fsync: after a crash the manifest is either the old or the new commit."""
    path = Path(root) / MANIFEST
    tmp = path.with_name(MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def is_store(root: Path) -> bool:
    root = Path(root)
    if (root / MANIFEST).is_file():
        return True
    try:
        group = json.loads((root / "zarr.json").read_text(encoding="utf-8"))
        return group.get("attributes", {}).get("marinctl", {}).get("format") == FORMAT
    except (OSError, json.JSONDecodeError, AttributeError):
        return False


def is_ours(root: Path) -> bool:
    """A missing or empty folder, a store, or what a killed first run leaves (only store entries)."""
    root = Path(root)
    if not root.exists():
        return True
    return root.is_dir() and (is_store(root) or all(p.name in _OWN_ENTRIES for p in root.iterdir()))


def remove_store(root: Path, *, keep: tuple[str, ...] = ()) -> None:
    """Delete only what a store consists of (never a folder the user pointed at by mistake)."""
    root = Path(root)
    if not is_ours(root):
        raise UserError(f"{root}: exists and is not a marinctl token store; refusing to overwrite it")
    for name in _OWN_ENTRIES:
        if name in keep:
            continue
        path = root / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


_ZSTD = {"name": "zstd", "configuration": {"level": 1}}


def _array_spec(path: Path, dtype: np.dtype | None = None) -> dict:
    spec: dict[str, Any] = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}}
    if dtype is not None:
        spec["metadata"] = {
            "shape": [0],
            "data_type": np.dtype(dtype).name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [CHUNK_BYTES // dtype.itemsize]}},
            # zstd level 1: ~2x smaller than raw tokens at twice the write speed of the default level 3.
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, _ZSTD],
            "fill_value": 0,
        }
    return spec


class StoreWriter:
    """Append documents; `commit` makes everything appended so far durable as one atomic step."""

    def __init__(self, root: Path, tokens: ts.TensorStore, offsets: ts.TensorStore, documents: int, n_tokens: int):
        self.root = Path(root)
        self._tokens, self._offsets = tokens, offsets
        self.committed_documents, self.committed_tokens = documents, n_tokens
        self._written = n_tokens  # tokens already in the array (committed or not)
        self._position = n_tokens  # tokens appended so far
        self._buffer: list[np.ndarray] = []  # tokens [_written, _position) not yet written
        self._ends: list[int] = []  # offsets of documents finished since the last commit
        self._doc_start: int | None = None
        self._dtype = tokens.dtype.numpy_dtype

    @classmethod
    def create(cls, root: Path, dtype: np.dtype) -> StoreWriter:
        root = Path(root)
        root.mkdir(parents=True, exist_ok=True)
        group = {"zarr_format": 3, "node_type": "group", "attributes": {"marinctl": {"format": FORMAT}}}
        (root / "zarr.json").write_text(json.dumps(group) + "\n", encoding="utf-8")
        tokens = ts.open(_array_spec(root / "tokens", np.dtype(dtype)), create=True, delete_existing=True).result()
        offsets = ts.open(_array_spec(root / "offsets", np.dtype(np.int64)), create=True, delete_existing=True)
        offsets = offsets.result().resize(exclusive_max=[1]).result()
        offsets[0:1].write(np.zeros(1, np.int64)).result()
        return cls(root, tokens, offsets, 0, 0)

    @classmethod
    def resume(cls, root: Path, documents: int, n_tokens: int) -> StoreWriter:
        """Reopen at the committed counts, dropping whatever an interrupted commit wrote beyond them."""
        root = Path(root)
        try:
            tokens = ts.open(_array_spec(root / "tokens")).result()
            offsets = ts.open(_array_spec(root / "offsets")).result()
        except ValueError as err:
            raise UserError(f"{root}: damaged token store ({err}); rerun with --overwrite") from None
        if tokens.shape[0] < n_tokens or offsets.shape[0] < documents + 1:
            raise UserError(f"{root}: arrays are shorter than the manifest says; rerun with --overwrite")
        tokens = tokens.resize(exclusive_max=[n_tokens]).result()
        offsets = offsets.resize(exclusive_max=[documents + 1]).result()
        last = int(offsets[documents].read().result())
        if last != n_tokens:
            raise UserError(f"{root}: offsets end at {last}, manifest says {n_tokens} tokens; rerun with --overwrite")
        return cls(root, tokens, offsets, documents, n_tokens)

    @property
    def documents(self) -> int:
        return self.committed_documents + len(self._ends)

    @property
    def tokens(self) -> int:
        return self._position

    @property
    def in_document(self) -> bool:
        return self._doc_start is not None

    def begin_document(self, bos_id: int | None) -> None:
        assert self._doc_start is None, "begin_document inside a document"
        self._doc_start = self._position
        if bos_id is not None:
            self.append(np.array([bos_id], np.int64))

    def append(self, ids: np.ndarray) -> None:
        if len(ids):
            self._buffer.append(ids.astype(self._dtype, copy=False))  # narrow ids now: half the memory
            self._position += len(ids)
        if self._position - self._written >= _FLUSH_TOKENS:
            self._flush()  # a 50 MB document streams to disk instead of piling up in memory

    def end_document(self, eos_id: int | None) -> None:
        assert self._doc_start is not None, "end_document outside a document"
        if eos_id is not None:
            self.append(np.array([eos_id], np.int64))
        self._ends.append(self._position)
        self._doc_start = None

    def abort_document(self) -> None:
        """Forget the open document (skipped as empty or invalid): later appends overwrite its tokens."""
        start = self._doc_start
        assert start is not None, "abort_document outside a document"
        if self._written > start:
            self._buffer, self._written = [], start
        else:
            keep, kept = start - self._written, []
            for ids in self._buffer:
                kept.append(ids[:keep])
                keep -= len(kept[-1])
            self._buffer = [ids for ids in kept if len(ids)]
        self._position, self._doc_start = start, None

    def commit(self, manifest: dict, *, before_manifest: Any = None) -> None:
        """Write pending data, then the manifest (which must describe exactly this state)."""
        assert self._doc_start is None, "commit inside a document"
        assert manifest["documents"] == self.documents and manifest["tokens"] == self.tokens
        self._flush()
        if self._ends:
            start = self.committed_documents + 1
            self._offsets = self._offsets.resize(exclusive_max=[start + len(self._ends)]).result()
            self._offsets[start : start + len(self._ends)].write(np.asarray(self._ends, np.int64)).result()
        if before_manifest is not None:
            before_manifest()  # test hook: the widest window in which a kill leaves uncommitted data
        write_manifest(self.root, manifest)
        self.committed_documents, self.committed_tokens, self._ends = self.documents, self.tokens, []

    def finish(self, manifest: dict) -> None:
        """Final commit; arrays shrink to exactly the committed counts (an aborted tail may remain)."""
        self.commit(manifest | {"complete": False})
        self._tokens = self._tokens.resize(exclusive_max=[self.tokens]).result()
        write_manifest(self.root, manifest)

    def _flush(self) -> None:
        if not self._buffer:
            return
        data = np.concatenate(self._buffer)
        end = self._written + len(data)
        if self._tokens.shape[0] < end:
            self._tokens = self._tokens.resize(exclusive_max=[end]).result()
        self._tokens[self._written : end].write(data).result()
        self._written, self._buffer = end, []


class JaggedStore:
    """A complete store opened for reading (the loader, tests, round trips)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        manifest = read_manifest(self.root)
        if manifest is None:
            raise UserError(f"{self.root}: no token store here (run `marinctl tokenize … --out {self.root}`)")
        if not manifest.get("complete"):
            raise UserError(f"{self.root}: token store is incomplete (interrupted tokenize?); rerun it to resume")
        self.manifest = manifest
        self.documents: int = manifest["documents"]
        self.num_tokens: int = manifest["tokens"]
        try:
            tokens = ts.open(_array_spec(self.root / "tokens")).result()
            offsets = ts.open(_array_spec(self.root / "offsets")).result()
        except ValueError as err:
            raise UserError(f"{self.root}: damaged token store ({err})") from None
        self._tokens = tokens[: self.num_tokens]
        self._offsets = offsets[: self.documents + 1]
        self._offsets_cache: np.ndarray | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets_cache is None:
            self._offsets_cache = self._offsets.read().result()
        return self._offsets_cache

    def read_tokens(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = self.num_tokens if stop is None else stop
        return self._tokens[start:stop].read().result()

    def read_many(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows tokens[s : s+length] for each start, read concurrently: [len(starts), length]."""
        futures = [self._tokens[int(s) : int(s) + length].read() for s in starts]
        return np.stack([f.result() for f in futures]) if futures else np.zeros((0, length), self._tokens.dtype)

    def document(self, i: int) -> np.ndarray:
        o = self.offsets
        return self.read_tokens(int(o[i]), int(o[i + 1]))
