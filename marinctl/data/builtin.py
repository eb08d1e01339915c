"""The built-in corpus: real text that ships with every Python installation, so the demo needs no download.

Two domains, each with a deterministic held-out split (the tiny recipe's macro loss averages over them):
- docs: `pydoc_data.topics` — the reference manual's topics as English prose (≈0.46 MB, one document per
  topic; 10% of topics, chosen by a hash of the topic name, are held out);
- code: the standard library's `.py` sources (tests, `pydoc_data`, `site-packages` excluded), files chosen
  in hash order of their relative path up to `CODE_BYTES` (each file one document; every 10th chosen file
  is held out).
The selection depends only on the installation's files, so every host and every rerun builds the same
stores; `ensure_builtin_corpus` is idempotent (a finished store is only re-hashed, ~0.1 s) and resumes an
interrupted build.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import math
import os
import sysconfig
from contextlib import contextmanager
from pathlib import Path

from marinctl.data.ingest import IngestOptions, ingest
from marinctl.data.readers import InputFile, MemoryInput
from marinctl.data.tokenizer import load_tokenizer
from marinctl.errors import UserError
from marinctl.recipe import Recipe

log = logging.getLogger(__name__)

CODE_BYTES = 4 << 20  # a few MB of code: builds in about a second, more than the demo's 150 steps read
CODE_MAX_FILE_BYTES = 200_000  # leave out the few giant generated modules
HELD_OUT_FRACTION = 0.1
STORES = ("docs_train", "docs_val", "code_train", "code_val")
_EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data", "_bundled"}


def _rank(domain: str, name: str) -> str:
    return hashlib.sha256(f"marinctl-builtin/{domain}/{name}".encode()).hexdigest()


def docs_split() -> tuple[MemoryInput, MemoryInput]:
    """Documentation topics, split into (train, held-out) by a hash of the topic name."""
    from pydoc_data.topics import topics

    names = sorted(topics, key=lambda n: _rank("docs", n))
    n_val = max(1, math.ceil(HELD_OUT_FRACTION * len(names)))
    val, train = sorted(names[:n_val]), sorted(names[n_val:])
    return (
        MemoryInput("pydoc_data.topics[train]", tuple(topics[n] for n in train)),
        MemoryInput("pydoc_data.topics[val]", tuple(topics[n] for n in val)),
    )


def code_split(stdlib: Path | None = None) -> tuple[list[InputFile], list[InputFile]]:
    """Standard-library sources up to CODE_BYTES in hash order, split into (train, held-out) files."""
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    candidates = []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]  # prune: site-packages can be huge
        for name in filenames:
            path = Path(dirpath) / name
            if not name.endswith(".py") or not path.is_file():
                continue
            rel = path.relative_to(stdlib)
            size = path.stat().st_size
            if 0 < size <= CODE_MAX_FILE_BYTES:
                candidates.append((_rank("code", rel.as_posix()), rel, path, size))
    if not candidates:
        raise UserError(f"{stdlib}: no standard-library sources found for the built-in corpus")
    train: list[InputFile] = []
    val: list[InputFile] = []
    total = 0
    for i, (_, rel, path, size) in enumerate(sorted(candidates)):
        if total >= CODE_BYTES:
            break
        file = InputFile(path.resolve(), f"<stdlib>/{rel.as_posix()}", "text", "", size)
        (val if i % round(1 / HELD_OUT_FRACTION) == 0 else train).append(file)
        total += size
    return sorted(train, key=lambda f: f.display), sorted(val, key=lambda f: f.display)


def ensure_builtin_corpus(recipe: Recipe, root: str | Path | None = None) -> dict[str, Path]:
    """Build (or verify) `<data.root>/python/{docs,code}_{train,val}`; returns store name → path."""
    kind = recipe.data.builtin
    if not kind:
        return {}
    if kind != "python":
        raise UserError(f"{recipe.source}: data.builtin: unknown built-in corpus {kind!r} (known: 'python')")
    base = Path(root if root is not None else recipe.data.root) / "python"
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    docs_train, docs_val = docs_split()
    code_train, code_val = code_split()
    inputs = {"docs_train": [docs_train], "docs_val": [docs_val], "code_train": code_train, "code_val": code_val}
    paths = {}
    with _lock(base):
        for name in STORES:
            path = base / name
            try:
                result = ingest(path, inputs[name], tokenizer, IngestOptions())
            except UserError:
                # The built-in stores are a cache: another tokenizer or Python version means rebuild.
                result = ingest(path, inputs[name], tokenizer, IngestOptions(), overwrite=True)
            if result["added_tokens"]:
                log.info("built-in corpus %s: %d documents, %d tokens", name, result["documents"], result["tokens"])
            paths[name] = path
    return paths


@contextmanager
def _lock(base: Path):
    """Serialize concurrent builders on one machine (two local processes of a multi-process run)."""
    base.mkdir(parents=True, exist_ok=True)
    with open(base / ".lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
