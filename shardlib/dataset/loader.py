"""Prepared datasets through grain: shuffled, mixed, sliced per process, packed, resumable.

The pipeline, per process (grain does each stage; nothing here re-implements it):

1. each dataset's documents (``Prepared.pieces``) as a ``grain.MapDataset``, shuffled with
   a seeded permutation that changes every epoch, repeated without end;
2. several datasets mixed by weight (``dataset.mix``, ``MapDataset.mix``);
3. this process's slice of the stream (``[process_index::process_count]``);
4. first-fit packing into rows of ``seq + 1`` tokens (``FirstFitPackIterDataset``: segment
   ids and positions restarting per document), ``batch / processes`` rows per step.

The iterator's state (a few integers) goes into every checkpoint, each process's own, so a
resumed run continues with exactly the batches an uninterrupted run would have read. Only
the held-out split is read by evaluation, always from its start and unshuffled.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import grain
import jax
import numpy as np
from jax.experimental import multihost_utils

from shardlib.core.errors import ShardingError
from shardlib.dataset.index import Prepared, is_prepared


def parse_mix(path: str | None, mix: str) -> list[tuple[str, float]]:
    """``dataset.mix="A:0.7,B:0.3"`` (or ``dataset=A``) as [(directory, weight)], checked."""
    if not mix:
        return [(path, 1.0)]
    pairs = []
    for part in mix.split(","):
        where, sep, weight = part.strip().rpartition(":")
        try:
            w = float(weight) if sep else float("nan")
        except ValueError:
            w = float("nan")
        if not where or not w > 0:
            raise ShardingError(
                f"dataset.mix: {part!r} is not DIR:WEIGHT with a weight > 0. Fix: e.g. "
                "dataset.mix=chat:0.7,code:0.3 (directories written by `shardlib data prepare`)."
            )
        pairs.append((where, w))
    return pairs


class Documents:
    """One split's items as grain records: ``tokens`` and per-token ``weights`` (the loss
    mask of each token as a target: 0 for prompt tokens, 1 otherwise)."""

    def __init__(self, data: Prepared, split: str, seq: int, source: int = 0) -> None:
        self.data, self.split, self.source = data, split, source
        self.pieces = data.pieces(split, seq)

    def __len__(self) -> int:
        return len(self.pieces.start)

    def __getitem__(self, i: int) -> dict:
        p = self.pieces
        tokens = self.data.read(self.split, int(p.shard[i]), int(p.start[i]), int(p.length[i]))
        weights = np.ones(len(tokens), np.float32)
        weights[: int(p.prompt[i])] = 0.0
        return {"tokens": tokens, "weights": weights, "source": self.source}


def documents(sets, split: str, seq: int, seed: int, *, shuffle: bool = True):
    """This process's endless stream of items, mixed by weight (stages 1-3 above)."""
    parts = []
    for i, (data, _) in enumerate(sets):
        ds = grain.MapDataset.source(Documents(data, split, seq, i))
        if shuffle:
            ds = ds.shuffle(seed=seed + i)  # a new permutation every epoch
        parts.append(ds.repeat(None))
    mixed = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, [w for _, w in sets])
    return mixed[jax.process_index() :: jax.process_count()]


def _drop_source(item: dict) -> dict:
    return {"tokens": item["tokens"], "weights": item["weights"]}


def to_rows(packed: dict) -> dict:
    """grain's packed features [rows, seq + 1] -> the step's batch (``train.step``).

    A target counts when it continues the same document as its input (never across a
    packing boundary or into padding, segment 0) with its own loss weight.
    """
    seg = packed["tokens_segment_ids"]  # [rows, seq + 1]
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
    return {
        "tokens": packed["tokens"].astype(np.int32),  # [rows, seq + 1]
        "weights": (packed["weights"][:, 1:] * same).astype(np.float32),  # [rows, seq]
        "segments": seg[:, :-1].astype(np.int32),  # [rows, seq]
        "positions": packed["tokens_positions"][:, :-1].astype(np.int32),  # [rows, seq]
    }


def packed_rows(sets, split: str, seq: int, rows: int, seed: int, *, shuffle: bool = True):
    """A grain ``IterDataset`` of this process's batches of ``rows`` packed rows."""
    docs = documents(sets, split, seq, seed, shuffle=shuffle).map(_drop_source)
    packed = grain.experimental.FirstFitPackIterDataset(
        # items are small preads: a thread pool's hand-offs would cost more than the reads
        docs.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)),
        length_struct={"tokens": seq + 1, "weights": seq + 1},
        num_packing_bins=rows,
        shuffle_bins=False,
    )
    return packed.batch(rows).map(to_rows)


@dataclass
class PreparedData:
    """The training run's view of one or more prepared datasets (``dataset=DIR`` or
    ``dataset.mix``): checks, global batches, evaluation batches and the loader's state."""

    sets: list[tuple[Prepared, float]]
    seq: int
    batch: int
    seed: int

    @classmethod
    def open(cls, path: str | None, mix: str, *, seq: int, batch: int, seed: int, vocab: int):
        """Open and check every dataset before any state is built or step compiled."""
        sets = []
        for where, weight in parse_mix(path, mix):
            if not is_prepared(where):
                raise ShardingError(
                    f"data: {where!r} is not a prepared dataset (no index.json). Fix: write it "
                    "with `shardlib data prepare`, or pass a flat uint16 token file as data=."
                )
            data = Prepared(where)
            if data.vocab_size > vocab:
                raise ShardingError(
                    f"data={where!r}: its tokenizer has {data.vocab_size} tokens, more than "
                    f"model.vocab={vocab}. Fix: model.vocab={data.vocab_size} (or more)."
                )
            sets.append((data, weight))
        processes = jax.process_count()
        if batch % processes:
            raise ShardingError(
                f"dataset.batch={batch} rows do not split over {processes} processes. Fix: a "
                f"multiple of {processes}."
            )
        out = cls(sets, seq, batch, seed)
        for data, _ in sets:
            data.pieces("train", seq)  # a too-long prompt/completion example fails here
        out._iter = iter(packed_rows(sets, "train", seq, out.local_rows, seed))
        return out

    @property
    def local_rows(self) -> int:
        return self.batch // jax.process_count()

    def identity(self) -> dict:
        """The datasets' identities (sizes, shard hashes) and weights, as one record."""
        ids = [(data.identity(), w) for data, w in self.sets]
        if len(ids) == 1:
            return ids[0][0]
        digest = hashlib.sha256(repr([(i["sample_sha256"], w) for i, w in ids]).encode())
        return {
            "path": ",".join(f"{i['path']}:{w}" for i, w in ids),
            "mtime": None,
            "bytes": sum(i["bytes"] for i, _ in ids),
            "sample_sha256": digest.hexdigest(),
        }

    @staticmethod
    def _global(local: dict, sharding) -> dict:
        return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}

    def batch_for(self, step: int, sharding) -> dict:
        """The next step's batch (``step`` follows from the iterator's state): each process's
        packed rows as one global array per field."""
        return self._global(next(self._iter), sharding)

    def eval_batches(self, count: int, sharding) -> list[dict]:
        """The held-out split's first ``count`` batches (unshuffled: the same every time)."""
        rows = packed_rows(self.sets, "eval", self.seq, self.local_rows, self.seed, shuffle=False)
        it = iter(rows)
        return [self._global(next(it), sharding) for _ in range(count)]

    def state(self) -> dict:
        """Every process's iterator state, gathered (each resumes its own slice)."""
        mine = self._iter.get_state()
        leaves, treedef = jax.tree.flatten(mine)
        if not all(isinstance(x, int | np.integer) for x in leaves):
            raise ShardingError(f"data: grain's iterator state {mine} is not integers.")
        every = multihost_utils.process_allgather(np.asarray(leaves, np.int64))
        every = np.asarray(every).reshape(jax.process_count(), len(leaves))
        return {"processes": [jax.tree.unflatten(treedef, [int(x) for x in row]) for row in every]}

    def restore(self, saved: dict | None) -> None:
        """Continue from a checkpoint's ``state()``."""
        states = (saved or {}).get("processes")
        if not states:
            raise ShardingError(
                "data: the checkpoint holds no loader state for this prepared dataset, so the "
                "batches after it cannot be reproduced. Fix: resume with the data it was "
                "trained on, or dataset.allow_changed=true to start the loader afresh."
            )
        if len(states) != jax.process_count():
            raise ShardingError(
                f"data: the checkpoint's loader ran on {len(states)} processes, this run on "
                f"{jax.process_count()}: each process's slice differs. Fix: resume with "
                f"{len(states)} processes (or dataset.allow_changed=true to restart the loader)."
            )
        self._iter.set_state(states[jax.process_index()])
