"""Which attention scores the XLA path computes: the query/key block geometry of `attention.py`.

One source for the code that computes the scores (`full_attention`, `banded_attention`) and the memory planner
that counts them (`marinctl.counting.memory_estimate`): when a block size changes here, both follow. Pure
Python, so the planner imports no JAX.
"""

from __future__ import annotations

import itertools


def causal_blocks(seq_len: int) -> int:
    """How many query blocks the full (global) path cuts the sequence into: 4 from S = 256, 8 from 1,024, one
    below 256. Block i attends only the keys before its end, so the scores cost (n+1)/2n of the square (62%
    with 4 blocks, 56% with 8). Measured on XLA:CPU, forward + backward (bench/README.md): 1.6-2× faster than
    the whole square at S = 256-1,024; more, smaller blocks ran slower (smaller matmuls)."""
    return 1 if seq_len < 256 else 4 if seq_len < 1024 else 8


def causal_bounds(seq_len: int, blocks: int | None = None) -> list[int]:
    """Query block i of the full path is rows `bounds[i]:bounds[i+1]`, reading keys `0:bounds[i+1]`."""
    n = blocks or causal_blocks(seq_len)
    return [seq_len * i // n for i in range(n + 1)]


def band_block(max_window: int) -> int:
    """Query block of the banded path: half the window (3 key blocks, 1.5·W keys per query) once the window
    is large enough for half-window matmuls to stay efficient; measured fastest on XLA:CPU at W = 64
    (1.1–1.4× over whole-window blocks at S = 512–1024, equal at 256)."""
    return max_window // 2 if max_window >= 64 else max_window


def band_shape(seq_len: int, max_window: int, block: int | None = None) -> tuple[int, int, int] | None:
    """(query block, query blocks, key blocks per query block) of the banded path; None when one block
    would cover the sequence, where the banded path runs the full one instead."""
    bq = block or band_block(max_window)
    if bq >= seq_len:
        return None
    return bq, -(-seq_len // bq), 1 + -(-(max_window - 1) // bq)


def global_scores(seq_len: int) -> int:
    """Score elements per query head and sequence of the full path: Σ over query blocks of rows × keys."""
    return sum((hi - lo) * hi for lo, hi in itertools.pairwise(causal_bounds(seq_len)))


def local_scores(seq_len: int, max_window: int) -> int:
    """Score elements per query head and sequence of the banded path (padded to whole blocks, as computed)."""
    band = band_shape(seq_len, max_window)
    if band is None:
        return global_scores(seq_len)
    bq, n, nk = band
    return n * bq * nk * bq
