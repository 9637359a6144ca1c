"""Reading a prepared dataset: its JSON index, checked shards, documents cut to the context.

A prepared directory holds ``index.json`` and flat token shards (``docs/data.md``). Opening
one checks everything that can be checked before a step runs: the format, every shard's
size and SHA-256 (a corrupt or truncated shard is an error naming the file), and, for a
given context, that no prompt/completion document is longer than a row. Tokens are read
with ``os.pread`` a document at a time (no memory map: a file truncated under a mapping
kills the process with SIGBUS and no message).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardlib.core.errors import ShardingError

FORMAT = "shardlib-tokens/1"
INDEX = "index.json"
SPLITS = ("train", "eval")


def is_prepared(path: str | os.PathLike | None) -> bool:
    """Is ``path`` a prepared dataset directory (it holds ``index.json``)?"""
    return path is not None and (Path(path) / INDEX).is_file()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Pieces:
    """The loader's items: documents, long plain-text ones cut into rows of at most seq + 1
    tokens that overlap by one token (so every next-token pair is kept exactly once)."""

    shard: np.ndarray  # [items] int32: which shard
    start: np.ndarray  # [items] int64: first token, in the shard
    length: np.ndarray  # [items] int64: tokens, <= seq + 1
    prompt: np.ndarray  # [items] int64: leading tokens that carry no loss (prompt)


class Prepared:
    """One prepared dataset: its index, checked, and its documents on demand."""

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = Path(directory)
        where = self.directory / INDEX
        try:
            self.index = json.loads(where.read_text())
        except (OSError, ValueError) as err:
            raise ShardingError(
                f"data={str(self.directory)!r}: {where} cannot be read ({err}). Fix: run "
                "`shardlib data prepare` again into a new directory."
            ) from None
        if self.index.get("format") != FORMAT:
            raise ShardingError(
                f"data={str(self.directory)!r}: {where} is not a {FORMAT} index "
                f"(format {self.index.get('format')!r}). Fix: prepare it with this shardlib."
            )
        self.dtype = np.dtype(self.index["dtype"])
        self.vocab_size = int(self.index["vocab_size"])
        self._fds: dict[str, int] = {}
        for split in SPLITS:
            for shard in self.shards(split):
                self._check_shard(shard)

    def shards(self, split: str) -> list[dict]:
        return self.index["splits"].get(split, {}).get("shards", [])

    def _check_shard(self, shard: dict) -> None:
        path = self.directory / shard["file"]
        want = int(shard["tokens"]) * self.dtype.itemsize
        if not path.is_file():
            raise ShardingError(f"data: shard {path} is missing. Fix: restore it or prepare again.")
        size = path.stat().st_size
        if size != want:
            raise ShardingError(
                f"data: shard {path} is corrupt: {size} bytes, the index says {want} "
                f"({shard['tokens']} {self.dtype.name} tokens). Fix: restore it or prepare again."
            )
        if file_sha256(path) != shard["sha256"]:
            raise ShardingError(
                f"data: shard {path} is corrupt: its SHA-256 differs from the index's. Fix: "
                "restore it or prepare the dataset again."
            )

    def documents(self, split: str) -> int:
        return sum(len(s["offsets"]) - 1 for s in self.shards(split))

    def pieces(self, split: str, seq: int) -> Pieces:
        """Every document of ``split`` as items of at most ``seq + 1`` tokens.

        A plain-text document longer than a row is cut (documented); a prompt/completion
        document is never cut, since its completion would be lost: it is an error naming it.
        Text and prompt/completion documents may share a shard (``prompt_tokens`` is then 0
        for the text ones, which are cut like any other text).
        """
        parts = []
        for i, shard in enumerate(self.shards(split)):
            offsets = np.asarray(shard["offsets"], np.int64)
            starts, lengths = offsets[:-1], np.diff(offsets)
            prompts = np.asarray(shard.get("prompt_tokens") or np.zeros_like(starts), np.int64)
            uncut = (lengths > seq + 1) & (prompts > 0)  # prompt/completion, longer than a row
            if uncut.any():
                doc = int(np.argmax(uncut))
                raise ShardingError(
                    f"data={str(self.directory)!r}: {split} document {doc} of {shard['file']} "
                    f"(prompt {prompts[doc]} + completion {lengths[doc] - prompts[doc]} tokens) "
                    f"is longer than a row of seq + 1 = {seq + 1} tokens, and prompt/completion "
                    "examples are never truncated. Fix: a larger seq, or drop or shorten that "
                    "example before `shardlib data prepare`."
                )
            cuts = np.maximum(1, -(-(lengths - 1) // seq))  # pieces per document
            first = np.repeat(starts, cuts)
            k = np.arange(cuts.sum()) - np.repeat(np.cumsum(cuts) - cuts, cuts)
            piece_start = first + k * seq
            end = np.repeat(starts + lengths, cuts)
            length = np.minimum(seq + 1, end - piece_start)
            prompt = np.where(k == 0, np.repeat(prompts, cuts), 0)
            keep = length >= 2  # one token predicts nothing
            parts.append(
                (np.full(keep.sum(), i, np.int32), piece_start[keep], length[keep], prompt[keep])
            )
        if not parts or not sum(len(p[0]) for p in parts):
            raise ShardingError(
                f"data={str(self.directory)!r}: the {split} split has no document of two or "
                "more tokens. Fix: "
                + (
                    "prepare it with --eval-fraction above 0, or eval_every=0."
                    if split == "eval"
                    else "prepare more data (or a smaller --eval-fraction)."
                )
            )
        return Pieces(*(np.concatenate(column) for column in zip(*parts, strict=True)))

    def read(self, split: str, shard: int, start: int, length: int) -> np.ndarray:
        """``length`` tokens of one shard from ``start``, as int32."""
        name = self.shards(split)[shard]["file"]
        fd = self._fds.get(name)
        if fd is None:
            fd = self._fds[name] = os.open(self.directory / name, os.O_RDONLY)
        size = self.dtype.itemsize
        data = os.pread(fd, length * size, start * size)
        if len(data) < length * size:
            raise ShardingError(
                f"data: shard {self.directory / name} ends before token {start + length} (it "
                "changed during the run). Fix: restore it and resume from the last checkpoint."
            )
        return np.frombuffer(data, self.dtype).astype(np.int32)

    def identity(self) -> dict:
        """What a checkpoint records about this dataset (compared on resume)."""
        digest = hashlib.sha256()
        total = 0
        for split in SPLITS:
            for shard in self.shards(split):
                digest.update(shard["sha256"].encode())
                total += int(shard["tokens"]) * self.dtype.itemsize
        return {
            "path": str(self.directory),
            "bytes": total,
            "mtime": None,
            "sample_sha256": digest.hexdigest(),
        }

    def __del__(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)
