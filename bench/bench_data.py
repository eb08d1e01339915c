"""Data benchmarks: tokenize throughput vs raw `tokenizers` batch encoding, and loader tokens/s vs training.

    python bench/bench_data.py [--repeat 2] [--vocab 8192] [--train-tokens-per-s X] [--json]

1. Tokenize: the built-in corpus's text (Python docs + stdlib code, ×repeat) written as one JSONL file, then
   - raw: `Tokenizer.encode_batch_fast` on all documents at once (the ceiling: encoding alone, in memory);
   - marinctl: `ingest` of the JSONL file (hash, read, decode, batch-encode, write zarr, commit), with a
     BPE tokenizer trained on the same text, and with the byte tokenizer.
   The ratio marinctl/raw says how much of the encoder's speed survives the pipeline.
2. Loader: `Loader.batch(step)` on the tiny recipe's built-in stores (and the prefetching iterator), against
   the training tokens/s the tiny recipe could reach at 100% MFU on this CPU (docs/recipe.md §7 FLOPs per token × 3 ÷
   a float32 matmul's FLOP/s measured here) — and against a measured training figure if given.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax

from marinctl.counting import flops_per_token
from marinctl.data.builtin import code_split, docs_split, ensure_builtin_corpus
from marinctl.data.ingest import ingest
from marinctl.data.loader import Loader
from marinctl.data.readers import discover_inputs
from marinctl.data.tokenizer import ByteTokenizer, train_tokenizer
from marinctl.recipe import load_recipe
from marinctl.train.metrics import measure_matmul_peak

REPO = Path(__file__).resolve().parents[1]


def corpus_documents(repeat: int) -> list[str]:
    docs_train, docs_val = docs_split()
    code_train, code_val = code_split()
    docs = list(docs_train.documents + docs_val.documents)
    docs += [f.path.read_text(encoding="utf-8", errors="replace") for f in code_train + code_val]
    return docs * repeat


def timed(fn, *args, **kwargs):
    started = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - started


def bench_tokenize(work: Path, repeat: int, vocab: int) -> dict:
    docs = corpus_documents(repeat)
    mb = sum(len(d.encode("utf-8")) for d in docs) / 1e6
    jsonl = work / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    tok, train_s = timed(train_tokenizer, iter(docs), vocab, work / "tokenizer.json")
    encoded, raw_s = timed(tok.hf.encode_batch_fast, docs, add_special_tokens=False)
    raw_tokens = sum(len(e.ids) for e in encoded)
    files = discover_inputs([jsonl])
    bpe, bpe_s = timed(ingest, work / "bpe", files, tok)
    _, byte_s = timed(ingest, work / "byte", files, ByteTokenizer())
    assert bpe["tokens"] == raw_tokens + 2 * bpe["documents"], "pipeline and raw encoding disagree"
    return {
        "corpus_mb": round(mb, 2),
        "documents": len(docs),
        "train_tokenizer_s": round(train_s, 2),
        "raw_encode_mb_per_s": round(mb / raw_s, 2),
        "raw_encode_tokens_per_s": round(raw_tokens / raw_s),
        "tokenize_bpe_mb_per_s": round(mb / bpe_s, 2),
        "tokenize_bpe_tokens_per_s": round(bpe["tokens"] / bpe_s),
        "tokenize_byte_mb_per_s": round(mb / byte_s, 2),
        "ratio_bpe_vs_raw": round(raw_s / bpe_s, 3),
    }


def bench_loader(work: Path, train_tokens_per_s: float | None) -> dict:
    recipe = load_recipe(REPO / "recipes" / "tiny.toml")
    _, build_s = timed(ensure_builtin_corpus, recipe, root=work / "data")
    _, cached_s = timed(ensure_builtin_corpus, recipe, root=work / "data")
    loader = Loader(recipe, root=work / "data")
    steps = recipe.train.steps
    _, batch_s = timed(lambda: [loader.batch(s) for s in range(steps)])
    with loader.iterate(0) as batches:
        _, iterate_s = timed(lambda: sum(1 for _ in batches))
    tokens = steps * recipe.tokens_per_step
    peak = measure_matmul_peak(jax.devices()[:1])  # the trainer's CPU MFU denominator
    train_flops_per_token = 3 * flops_per_token(recipe).per_token
    ceiling = peak / train_flops_per_token
    out = {
        "builtin_build_s": round(build_s, 2),
        "builtin_cached_s": round(cached_s, 3),
        "loader_tokens_per_s": round(tokens / batch_s),
        "loader_iterate_tokens_per_s": round(tokens / iterate_s),
        "cpu_matmul_gflop_per_s": round(peak / 1e9, 1),
        "train_tokens_per_s_at_100pct_mfu": round(ceiling),
        "loader_vs_100pct_mfu_training": round(tokens / batch_s / ceiling, 1),
    }
    if train_tokens_per_s:
        out["loader_vs_measured_training"] = round(tokens / batch_s / train_tokens_per_s, 1)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2, help="copies of the built-in text in the tokenize corpus")
    parser.add_argument("--vocab", type=int, default=8192, help="vocab of the BPE trained for the comparison")
    parser.add_argument("--train-tokens-per-s", type=float, default=None, help="measured tiny training speed")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_data_") as tmp:
        work = Path(tmp)
        results = {"tokenize": bench_tokenize(work, args.repeat, args.vocab)}
        results["loader"] = bench_loader(work, args.train_tokens_per_s)
    if args.json:
        print(json.dumps(results))
        return
    for section, values in results.items():
        print(f"[{section}]")
        for key, value in values.items():
            print(f"  {key:36s} {value:>14,}" if isinstance(value, int) else f"  {key:36s} {value:>14}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
