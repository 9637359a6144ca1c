"""A user's own batches for the generic trainer: any tree of arrays, each dim named.

The trainer of a model of one's own (``train.user_model``) reads batches that the user
makes: a dict (or any pytree) of numpy arrays, ``{"image": [b, h, w, c], "label": [b]}``,
with the logical name of every dim declared once, ``{"image": ("batch", None, None,
None), "label": ("batch",)}``. The names go through the plan's activation rules, like the
model's own ``constrain`` calls, so a batch is split over the data-parallel axes however
the mesh is laid out, and each array is checked (rank, divisibility) before step 1.

The source is one of:

* a sequence (``len`` and ``[i]``: a list, a grain ``MapDataset``): step ``i`` reads item
  ``i % len``, so a resumed run reads exactly the batches an uninterrupted one would;
* an iterable (a generator function's result, a grain ``IterDataset``) or a function of no
  arguments that returns one: batches in order; a run resumed at step ``k`` skips the
  first ``k`` (the batches must come out the same each time for the resume to be exact).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from shardlib.core.errors import ShardingError
from shardlib.parallel.state import batch_sharding


def _is_names(node) -> bool:
    return isinstance(node, tuple) and all(n is None or isinstance(n, str) for n in node)


@dataclass(eq=False)
class Batches:
    """Where a user's batches come from, and the logical names of their dims."""

    source: Any
    """A sequence, an iterable, or a function of no arguments returning an iterable
    (module docstring)."""
    names: Any
    """A tree like one batch's, a tuple of logical names (or None) per array, one per dim:
    ``{"image": ("batch", None, None, None), "label": ("batch",)}``."""
    name: str = "batches"
    """What the run records as its data (``data=pkg.mod:NAME``'s NAME)."""
    held_out: Any = None
    """Held-out batches with the same names (a sequence or iterable, or a function returning
    one): ``eval_every=N`` evaluates the model on the first ``eval_batches`` of them every N
    steps; None: no held-out data."""
    _iterator: Iterator | None = field(default=None, repr=False)
    _next: int = field(default=0, repr=False)
    _first: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        leaves = jax.tree.leaves(self.names, is_leaf=_is_names)
        if not leaves or not all(_is_names(n) for n in leaves):
            raise ShardingError(
                f"data {self.name}: names={self.names!r} must give each batch array a tuple of "
                "logical dim names. Fix: e.g. names={'image': ('batch', None, None, None), "
                "'label': ('batch',)}."
            )

    # --- reading -----------------------------------------------------------------------------
    def _random_access(self) -> bool:
        return hasattr(self.source, "__len__") and hasattr(self.source, "__getitem__")

    def host_batch(self, step: int):
        """The batch of step ``step`` as the source gives it (numpy arrays)."""
        if self._random_access():
            if len(self.source) == 0:
                raise ShardingError(f"data {self.name}: the sequence of batches is empty.")
            return self.source[step % len(self.source)]
        if self._iterator is None or step < self._next:
            self._iterator, self._next = iter(self._open()), 0
        while self._next < step:  # a resumed run: skip what was trained on already
            self._read(step)
        return self._read(step)

    def _open(self) -> Iterable:
        source = self.source
        if callable(source) and not isinstance(source, Iterable):
            source = source()
        if not isinstance(source, Iterable):
            raise ShardingError(
                f"data {self.name}: {type(source).__name__} is not a source of batches. Fix: a "
                "list or grain dataset of batches, an iterable, or a function returning one."
            )
        return source

    def _read(self, step: int):
        try:
            batch = next(self._iterator)
        except StopIteration:
            raise ShardingError(
                f"data {self.name}: the batches ran out at step {self._next + 1} (the run asks "
                f"for step {step + 1}). Fix: a source with a batch for every step (repeat it), "
                "or fewer steps."
            ) from None
        self._next += 1
        return batch

    @property
    def first(self):
        """Step 0's batch (read once: shapes, dtypes, the data's fingerprint)."""
        if self._first is None:
            self._first = self.checked(self.host_batch(0))
        return self._first

    def checked(self, batch):
        """``batch`` as numpy arrays, its tree and ranks checked against ``names``."""
        try:
            arrays = jax.tree.map(lambda n, x: np.asarray(x), self.names, batch, is_leaf=_is_names)
        except (ValueError, TypeError) as err:
            raise ShardingError(
                f"data {self.name}: a batch's arrays do not match names ({err}). Fix: name "
                f"exactly the batch's arrays: names={self.names!r}."
            ) from None
        flat = jax.tree_util.tree_flatten_with_path(self.names, is_leaf=_is_names)[0]
        for (path, names), x in zip(flat, jax.tree.leaves(arrays), strict=True):
            if x.ndim != len(names):
                where = jax.tree_util.keystr(path)
                raise ShardingError(
                    f"data {self.name}: batch array {where} has shape {x.shape} ({x.ndim} dims) "
                    f"but names {names} ({len(names)} dims). Fix: one name (or None) per dim."
                )
        return arrays

    # --- layout --------------------------------------------------------------------------
    def shardings(self, mesh: Mesh, rules) -> Any:
        """One NamedSharding per array, checked against step 0's shapes (the batch dim must
        divide by the mesh axes it is split over)."""
        flat = jax.tree_util.tree_flatten_with_path(self.names, is_leaf=_is_names)[0]
        treedef = jax.tree.structure(self.names, is_leaf=_is_names)
        out = []
        for (path, names), x in zip(flat, jax.tree.leaves(self.first), strict=True):
            try:
                out.append(batch_sharding(mesh, rules, names, shape=x.shape))
            except ShardingError as err:
                where = jax.tree_util.keystr(path)
                raise ShardingError(f"data {self.name}, batch array {where}: {err}") from None
        return jax.tree.unflatten(treedef, out)

    def abstract(self, shardings) -> Any:
        """Step 0's batch as ShapeDtypeStructs with their shardings (nothing allocated)."""
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            self.first,
            shardings,
        )

    @property
    def examples(self) -> int:
        """Examples per step: the leading dim of the batch's first array."""
        return int(jax.tree.leaves(self.first)[0].shape[0])

    # --- the loop's data interface (``train.loop``) ----------------------------------------
    def batch_for(self, step: int, shardings) -> Any:
        batch = self.first if step == 0 else self.checked(self.host_batch(step))
        return self._placed(batch, shardings)

    def identity(self) -> dict:
        """What the run trains on, compared on resume: step 0's bytes and their hash."""
        digest = hashlib.sha256()
        size = 0
        for x in jax.tree.leaves(self.first):
            digest.update(np.ascontiguousarray(x).tobytes())
            size += x.nbytes
        return {"path": self.name, "bytes": size, "sample_sha256": digest.hexdigest()}

    def state(self) -> None:
        return None  # the position is the step: nothing else to save

    def eval_batches(self, count: int, shardings) -> list:
        """The first ``count`` held-out batches, on the batch's layout (the same ones at
        every evaluation; fewer where the held-out data has fewer)."""
        if self.held_out is None:
            raise ShardingError(
                f"data {self.name}: dataset.eval_every evaluates on held-out batches, and "
                "these batches have none. Fix: shardlib.Batches(source, names, held_out="
                "eval_source), or eval_every=0."
            )
        held = Batches(self.held_out, self.names, f"{self.name} (held out)")
        source = held._open() if not held._random_access() else held.source
        out = []
        for batch in source:
            out.append(self._placed(held.checked(batch), shardings))
            if len(out) == count:
                break
        if not out:
            raise ShardingError(f"data {self.name}: the held-out batches are empty.")
        return out

    @staticmethod
    def _placed(batch, shardings):
        return jax.tree.map(
            lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: x[i]),
            batch,
            shardings,
        )


def as_batches(data: Any, names: Mapping | None = None, name: str = "batches") -> Batches:
    """``data`` as ``Batches``: one already, or a source with ``names`` beside it."""
    if isinstance(data, Batches):
        return data
    if callable(data) and not isinstance(data, Iterable) and names is None:
        made = data()  # a function returning Batches (``data=pkg.mod:function``)
        if isinstance(made, Batches):
            return made
        data = made
    if names is None:
        raise ShardingError(
            f"data {name}: the logical names of the batch's dims are not given. Fix: "
            "shardlib.Batches(source, names={'image': ('batch', None, None, None), "
            "'label': ('batch',)}), or names=... beside the source."
        )
    return Batches(data, names, name)
