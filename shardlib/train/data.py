"""Token data: an embedded default corpus, or a flat file of uint16 token ids.

The default corpus is the Python standard library's own source, read as bytes (vocab 256):
it ships with every Python, needs no download, and a byte-level model's loss falls on it
within a few dozen steps. Batches are a pure function of (seed, step), so a resumed run
reads exactly what the uninterrupted run would, and each process materialises only the rows
its own devices hold.
"""

from __future__ import annotations

import sysconfig
from functools import cache
from pathlib import Path

import jax
import numpy as np

from shardlib.errors import ShardingError

DEFAULT_CORPUS_BYTES = 4 << 20
BATCH_NAMES = ("batch", None)  # tokens [batch, seq + 1]: positions are never split on input


@cache
def embedded_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> np.ndarray:
    """The stdlib's ``.py`` files, sorted by path and concatenated, as uint8 tokens."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def load_tokens(path: str | None) -> np.ndarray:
    """Memory-mapped uint16 token ids from ``path``, or the embedded corpus."""
    if path is None:
        return embedded_corpus()
    p = Path(path)
    if not p.is_file():
        raise ShardingError(f"data={path!r}: no such file. Fix: pass a flat uint16 token file.")
    if p.stat().st_size % 2 or p.stat().st_size < 4:
        raise ShardingError(
            f"data={path!r}: {p.stat().st_size} bytes is not a whole number of uint16 tokens "
            "(at least 2). Fix: write the ids as uint16, e.g. "
            "np.asarray(ids, np.uint16).tofile(path)."
        )
    return np.memmap(p, dtype=np.uint16, mode="r")


def check_vocab(tokens: np.ndarray, vocab: int, source: str | None) -> None:
    """Token ids must index the embedding; checks the first million tokens of a file."""
    top = int(np.asarray(tokens[: 1 << 20]).max())
    if top >= vocab:
        raise ShardingError(
            f"data={source or 'embedded'}: token id {top} >= model vocab {vocab}. Fix: set "
            f"model.vocab={max(top + 1, 256)} or use a tokenizer with a smaller vocabulary."
        )


def batch_starts(num_tokens: int, step: int, batch: int, seq: int, seed: int) -> np.ndarray:
    """Start offsets of the ``batch`` windows of step ``step``: a pure function of its inputs."""
    if num_tokens <= seq + 1:
        raise ShardingError(f"data: {num_tokens} tokens cannot fill one window of {seq + 1}.")
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, num_tokens - seq - 1, size=batch)


def global_batch(
    tokens: np.ndarray, step: int, batch: int, seq: int, seed: int, sharding: jax.sharding.Sharding
) -> jax.Array:
    """The step's [batch, seq + 1] int32 tokens as one global array laid out by ``sharding``.

    ``make_array_from_callback`` asks only for the slices this process's devices hold, so
    each host reads just its own rows of the file.
    """
    starts = batch_starts(len(tokens), step, batch, seq, seed)

    def rows(index) -> np.ndarray:
        picked = starts[index[0]]
        out = np.stack([np.asarray(tokens[s : s + seq + 1]) for s in picked])
        return out[(slice(None),) + tuple(index[1:])].astype(np.int32)

    return jax.make_array_from_callback((batch, seq + 1), sharding, rows)
