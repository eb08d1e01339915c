"""`marinctl tokenize`: text, JSONL and Parquet inputs → a resumable zarr v3 jagged token store (docs/recipe.md §6)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from marinctl.errors import UserError
from marinctl.stage import JsonOpt, QuietOpt, Stage, VerboseOpt, console, emit_json, setup_logging

HELP = "\n\n".join(
    [
        "Tokenize text files/folders, JSONL (.jsonl, .jsonl.gz, .jsonl.zst) and Parquet into a token store.",
        "A text file is one document; a JSONL line or Parquet row is one document (its --text-field). An "
        "interrupted run resumes where it last committed; a finished store whose inputs are a prefix of the new "
        "ones is appended to.",
        "Bad input: invalid UTF-8 is replaced with U+FFFD (with --invalid-utf8 skip the document is dropped) and "
        "counted in invalid_utf8; empty or whitespace-only documents are skipped and counted in skipped_empty; an "
        "unreadable or malformed file (binary, bad JSON, missing field, truncated .gz/.zst, broken Parquet) stops "
        "the run with one line naming it, or with --skip-bad-files is skipped and counted in skipped_files "
        "(documents read from it before the error are kept).",
        "Exit codes: 0 done (also when --skip-bad-files skipped files: see skipped_files); 2 user error (bad flags, "
        "missing input, a bad file without --skip-bad-files, a store made from other inputs or another tokenizer).",
    ]
)


class _RateColumn(ProgressColumn):
    def __init__(self, field: str, unit: str):
        super().__init__()
        self.field, self.unit = field, unit

    def render(self, task: Task) -> Text:
        elapsed = task.elapsed or 0.0
        rate = task.fields.get(self.field, 0) / elapsed if elapsed > 0 else 0.0
        return Text(f"{rate:,.0f} {self.unit}/s", style="progress.data.speed")


def tokenize(
    inputs: Annotated[list[Path], typer.Argument(help="Files or folders to tokenize.", show_default=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Store directory to create or resume.")],
    tokenizer: Annotated[str, typer.Option("--tokenizer", help="'byte' or a path to an HF tokenizer.json.")] = "byte",
    train_vocab: Annotated[
        int | None,
        typer.Option("--train-tokenizer", help="Train a byte-level BPE of this vocab size on the inputs.", min=1),
    ] = None,
    text_field: Annotated[str, typer.Option("--text-field", help="JSONL key / Parquet column of the text.")] = "text",
    invalid_utf8: Annotated[
        str, typer.Option("--invalid-utf8", help="'replace' (U+FFFD, keep) or 'skip' (drop the document).")
    ] = "replace",
    skip_bad_files: Annotated[
        bool, typer.Option("--skip-bad-files", help="Skip unreadable/malformed files instead of failing.")
    ] = False,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Delete an existing store at --out first.")] = False,
    commit_tokens: Annotated[
        int, typer.Option("--commit-tokens", help="Commit (crash-safe point) after about this many tokens.", min=1)
    ] = 1 << 22,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
    verbose: VerboseOpt = 0,
) -> int:
    # Imported here so `marinctl --help` does not pay for numpy and tensorstore.
    from marinctl.data.ingest import IngestOptions, ingest
    from marinctl.data.readers import discover_inputs
    from marinctl.data.store import remove_store
    from marinctl.data.tokenizer import load_tokenizer

    setup_logging(quiet, verbose)
    if invalid_utf8 not in ("replace", "skip"):
        raise UserError(f"--invalid-utf8 {invalid_utf8!r}: choose 'replace' or 'skip'")
    if train_vocab is not None and tokenizer != "byte":
        raise UserError("--tokenizer and --train-tokenizer are exclusive: give one")
    options = IngestOptions(
        text_field=text_field, invalid_utf8=invalid_utf8, skip_bad_files=skip_bad_files, commit_tokens=commit_tokens
    )
    files = discover_inputs(inputs)
    con = console()
    if overwrite:
        remove_store(out)

    tokenizer_info = None
    if train_vocab is not None:
        tok, tokenizer_info = _trained_tokenizer(out, files, options, train_vocab, con, quiet)
    else:
        tok = load_tokenizer(tokenizer)

    columns = (
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        _RateColumn("documents", "docs"),
        _RateColumn("tokens", "tok"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=con, disable=quiet, transient=False) as bar:
        task = bar.add_task("hashing", total=None, documents=0, tokens=0)
        start_docs: list[int] = []

        def report(p) -> None:
            if p.phase == "tokenizing" and not start_docs:
                start_docs[:] = [p.documents, p.tokens]  # rates count this session's work, not a resume's
                bar.reset(task, total=p.bytes_total, completed=p.bytes_done)
            base = start_docs or [0, 0]
            bar.update(
                task,
                description=f"{p.phase} {p.files_done}/{p.files_total} files",
                completed=p.bytes_done,
                total=p.bytes_total if p.phase != "hashing" else None,
                documents=p.documents - base[0],
                tokens=p.tokens - base[1],
            )

        result = ingest(out, files, tok, options, tokenizer_info=tokenizer_info, on_progress=report)

    if json_out:
        emit_json(result)
    if not quiet:
        con.print(_summary_table(result))
    return 0


def _trained_tokenizer(out: Path, files, options, vocab: int, con, quiet: bool):
    """Reuse the tokenizer a previous (interrupted) run trained for this store, else train one."""
    from marinctl.data.ingest import training_texts
    from marinctl.data.store import TOKENIZER_FILE, read_manifest
    from marinctl.data.tokenizer import load_tokenizer, train_tokenizer

    path = out / TOKENIZER_FILE
    info = {"trained": True, "file": TOKENIZER_FILE, "train_vocab_size": vocab}
    previous = read_manifest(out)
    if previous is not None and previous["tokenizer"].get("trained") and path.is_file():
        tok = load_tokenizer(path)
        if tok.identity == previous["tokenizer"]["identity"]:
            return tok, info
    if previous is not None:
        raise UserError(f"{out}: holds a store made without this tokenizer; pass --overwrite to rebuild it")
    if not quiet:
        con.print(f"training a byte-level BPE tokenizer (vocab {vocab:,}) on {len(files)} files …")
    started = time.perf_counter()
    tok = train_tokenizer(training_texts(files, options), vocab, path)
    if not quiet:
        con.print(f"trained in {time.perf_counter() - started:.1f}s → {path}")
    return tok, info


def _summary_table(result: dict) -> Table:
    table = Table(title="tokenize", show_header=False, title_justify="left")
    table.add_column("", style="bold")
    table.add_column("", justify="right")
    seconds = max(result["seconds"], 1e-9)
    rows = [
        ("store", result["store"]),
        ("tokenizer", f"{result['tokenizer']} (vocab {result['vocab_size']:,})"),
        ("files", f"{result['files']:,}"),
        ("documents", f"{result['documents']:,}"),
        ("tokens", f"{result['tokens']:,}"),
        ("text bytes", f"{result['text_bytes']:,}"),
        ("bytes / token", f"{result['text_bytes'] / max(result['tokens'], 1):.3f}"),
        ("skipped empty", f"{result['skipped_empty']:,}"),
        ("invalid UTF-8", f"{result['invalid_utf8']:,}"),
        ("skipped files", f"{result['skipped_files']:,}"),
        ("resumed", "yes" if result["resumed"] else "no"),
        ("time", f"{result['seconds']:.2f} s"),
        ("added this run", f"{result['added_documents']:,} documents, {result['added_tokens']:,} tokens"),
        ("tokens / s (this run)", f"{result['added_tokens'] / seconds:,.0f}"),
    ]
    for bad in result["bad_files"]:
        rows.append(("skipped", f"{bad['path']}: {bad['error']}"))
    for key, value in rows:
        table.add_row(key, value)
    return table


stage = Stage(name="tokenize", help=HELP, command=tokenize)
