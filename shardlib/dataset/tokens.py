"""Token data: an embedded default corpus, or a flat file of uint16 token ids (``FlatData``).

Prepared datasets (packed, masked, with a held-out split) are ``shardlib.dataset``'s; this is
the zero-setup path, and its batches stay exactly what they were before those existed.
Evaluation on the embedded corpus reads the standard-library source after the training
bytes (``embedded_held_out``), never trained on.

The default corpus is the Python standard library's own source, read as bytes (vocab 256):
it ships with every Python, needs no download, and a byte-level model's loss falls on it
within a few dozen steps. Batches are a pure function of (seed, step), so a resumed run
reads exactly what the uninterrupted run would, and each process materialises only the rows
its own devices hold.

A token file is read with ``os.pread``, not memory-mapped: a file truncated under a mapping
kills the process with SIGBUS and no message. Before each step the file is checked against
what was opened (size, modification time, inode of the path), so a file truncated, rewritten
or replaced mid-run stops the run with an error naming it. ``identity`` (size, modification
time and a hash of evenly spaced samples) goes into every checkpoint, so that a resume on
other data is refused (``shardlib.checkpoint.resume``).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from functools import cache
from pathlib import Path

import jax
import numpy as np

from shardlib.core.errors import ShardingError

DEFAULT_CORPUS_BYTES = 4 << 20
SAMPLES, SAMPLE_BYTES = 16, 64 << 10  # identity: 1 MiB read at most, spread over the file
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


class TokenFile:
    """A flat uint16 token file, read a window at a time; ``len`` and slices like an array."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        self._opened = os.fstat(self._fd)
        self._tokens = self._opened.st_size // 2

    def __len__(self) -> int:
        return self._tokens

    def __del__(self) -> None:
        os.close(self._fd)

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop, _ = window.indices(self._tokens)
        want = max(stop - start, 0) * 2
        data = os.pread(self._fd, want, start * 2)
        if len(data) < want:
            self.check()  # names what changed, when it can tell
            raise ShardingError(
                f"data={self.path!r}: tokens {start}..{stop} could not be read (the file "
                f"now ends at byte {start * 2 + len(data)}). Fix: restore the file."
            )
        return np.frombuffer(data, dtype=np.uint16)

    def check(self) -> None:
        """The file is still the one opened (same size, mtime, inode at its path)."""
        now = os.fstat(self._fd)
        try:
            at_path = os.stat(self.path)
        except OSError:
            at_path = None
        before = self._opened
        change = None
        if now.st_size != before.st_size:
            change = f"its size changed from {before.st_size} to {now.st_size} bytes"
        elif now.st_mtime_ns != before.st_mtime_ns:
            change = "it was rewritten (its modification time changed)"
        elif at_path is None or (at_path.st_ino, at_path.st_dev) != (now.st_ino, now.st_dev):
            change = "it was replaced or removed"
        if change:
            raise ShardingError(
                f"data={self.path!r} changed during the run: {change}. Fix: restore the file "
                "and resume from the last checkpoint (to train on the new data on purpose, "
                "resume with dataset.allow_changed=true)."
            )

    def identity(self) -> dict:
        return _identity(self, self.path, self._opened.st_size, self._opened.st_mtime)


def _identity(tokens, path: str | None, size: int, mtime: float | None) -> dict:
    """What the checkpoint records about its data: size, mtime, a hash of samples."""
    digest = hashlib.sha256(str(size).encode())
    n, width = len(tokens), SAMPLE_BYTES // 2
    for i in range(SAMPLES):
        start = (n - width) * i // (SAMPLES - 1) if n > width else 0
        digest.update(np.asarray(tokens[start : start + width]).tobytes())
    return {"path": path, "bytes": size, "mtime": mtime, "sample_sha256": digest.hexdigest()}


def data_identity(tokens) -> dict:
    """``TokenFile.identity`` or, for the embedded corpus, the same without path and mtime."""
    if isinstance(tokens, TokenFile):
        return tokens.identity()
    return _identity(tokens, None, tokens.nbytes, None)


def check_unchanged(tokens) -> None:
    """Before each step: a token file must still be the one the run opened."""
    if isinstance(tokens, TokenFile):
        tokens.check()


def load_tokens(path: str | None) -> np.ndarray | TokenFile:
    """uint16 token ids from ``path`` (read on demand), or the embedded corpus."""
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
    return TokenFile(path)


def check_vocab(tokens: np.ndarray | TokenFile, vocab: int, source: str | None) -> None:
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
    tokens: np.ndarray | TokenFile,
    step: int,
    batch: int,
    seq: int,
    seed: int,
    sharding: jax.sharding.Sharding,
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


HELD_OUT_BYTES = 512 << 10  # the embedded corpus's evaluation bytes, after the training ones
EVAL_SEED = 1 << 20  # evaluation windows: a fixed stream apart from any training seed


def embedded_held_out() -> np.ndarray:
    """The stdlib source right after the embedded corpus's training bytes: never trained on."""
    return embedded_corpus(DEFAULT_CORPUS_BYTES + HELD_OUT_BYTES)[DEFAULT_CORPUS_BYTES:]


class FlatData:
    """The plain path behind the same interface as ``shardlib.dataset.loader.PreparedData``:
    the embedded corpus or a flat uint16 file, random windows, every target counted."""

    def __init__(self, tokens, path: str | None, *, batch: int, seq: int, seed: int) -> None:
        self.tokens, self.path = tokens, path
        self.batch, self.seq, self.seed = batch, seq, seed

    def identity(self) -> dict:
        return data_identity(self.tokens)

    def batch_for(self, step: int, sharding) -> jax.Array:
        """Step ``step``'s [batch, seq + 1] tokens: a pure function of (seed, step)."""
        check_unchanged(self.tokens)
        return global_batch(self.tokens, step, self.batch, self.seq, self.seed, sharding)

    def eval_batches(self, count: int, sharding) -> list[jax.Array]:
        """Windows of the embedded corpus's held-out bytes, the same ones every time."""
        if self.path is not None:
            raise ShardingError(
                f"eval_every: data={self.path!r} is a flat token file with no held-out part. "
                "Fix: prepare the data with `shardlib data prepare` (it writes an eval split), "
                "or eval_every=0."
            )
        held = embedded_held_out()
        return [
            global_batch(held, i, self.batch, self.seq, EVAL_SEED, sharding) for i in range(count)
        ]

    def state(self) -> None:
        return None  # batches are a function of the step: nothing to save

    def restore(self, saved) -> None:
        return None
