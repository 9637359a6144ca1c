"""ZeRO-Infinity's NVMe tier for the stacked weights: ``params["blocks"]`` in files, read one
layer at a time by the layer loop and written back one layer at a time by the update.

Each stacked weight is one file under the directory (a ``numpy.memmap``, ``[layers, ...]``
fp32 master weights, as ``offload_nvme`` keeps the optimizer state). The gradient program
never takes the weights as an input: inside the layer loop's scan (``layer_loop``), trip
``i`` calls ``jax.pure_callback`` to read layer ``i``'s rows from the files, and the
result goes through ``offload_grads.tap`` so that its gradient leaves for host memory as
the backward produces it. The scan's body is checkpointed with nothing saved, so the
backward reads each layer again (in reverse order) instead of keeping it: the device holds
the layer being computed. The callback is pure (the files do not change during the
program), so XLA may recompute or reorder it but not skip a read the result needs.

The update (``offload_nvme.NvmeOptimizerState.update_files``) reads layer ``i``'s weights
into pinned host memory with its optimizer-state rows, updates them on the device, and
writes both back. Per step the weights are read three times (forward, backward, update)
and written once (``io``).
"""

from __future__ import annotations

import contextlib
import contextvars
import shutil
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np

from shardlib.parallel.offload_nvme import Io

_FILES: contextvars.ContextVar = contextvars.ContextVar("shardlib_nvme_params", default=None)


class NvmeParams:
    """The stacked weights ``params["blocks"]``, one file per leaf under ``path``."""

    def __init__(self, blocks, path) -> None:
        """``blocks``: the stacked weights' tree (arrays or shape structs, ``[layers, ...]``)."""
        self.path = Path(path)
        self.leaves, self.treedef = jax.tree.flatten(blocks)
        self.layers = self.leaves[0].shape[0]
        self.files: list[np.memmap] = []
        self.io = Io()

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in self.leaves)

    def _name(self, j: int) -> str:
        return f"param{j:03d}.bin"

    def open(self, mode: str) -> NvmeParams:
        self.path.mkdir(parents=True, exist_ok=True)
        self.files = [np.memmap(self.path / self._name(j), x.dtype, mode, shape=x.shape)
                      for j, x in enumerate(self.leaves)]  # fmt: skip
        return self

    @classmethod
    def create(cls, blocks, path) -> NvmeParams:
        """New files holding ``blocks`` (host or device arrays), one layer at a time."""
        self = cls(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), blocks), path)
        self.open("w+")
        for f, x in zip(self.files, jax.tree.leaves(blocks), strict=True):
            for i in range(self.layers):
                f[i] = np.asarray(x[i])
            f.flush()
        return self

    def row_shapes(self) -> list[jax.ShapeDtypeStruct]:
        """One layer's leaves (no layers dim), what ``read_layer`` returns."""
        return [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in self.leaves]

    def read_layer(self, i) -> list[np.ndarray]:
        """Layer ``i``'s leaves from the files (the layer loop's callback)."""
        rows = [np.array(f[int(i)]) for f in self.files]
        self.io.read += sum(r.nbytes for r in rows)
        return rows

    def read_rows(self, i: int) -> list[np.ndarray]:
        """Layer ``i``'s leaves as ``[1, ...]`` rows (the update's)."""
        return [r[None] for r in self.read_layer(i)]

    def write_rows(self, i: int, rows) -> None:
        for f, r in zip(self.files, rows, strict=True):
            data = np.asarray(r)
            f[i : i + 1] = data
            self.io.written += data.nbytes

    def flush(self) -> None:
        for f in self.files:
            f.flush()

    def tree(self):
        """The stacked weights as a tree of ``numpy.memmap`` views (nothing read yet)."""
        return jax.tree.unflatten(self.treedef, [np.asarray(f) for f in self.files])

    def save(self, directory) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.flush()
        for j in range(len(self.files)):
            shutil.copyfile(self.path / self._name(j), directory / self._name(j))

    def load(self, directory) -> None:
        """Replace the weights by those saved in ``directory`` (copied into ``path``)."""
        self.files = []
        for j in range(len(self.leaves)):
            shutil.copyfile(Path(directory) / self._name(j), self.path / self._name(j))
        self.open("r+")


@contextlib.contextmanager
def reading(store: NvmeParams) -> Iterator[None]:
    """Within: the layer loop reads the stacked weights from ``store`` (trace time)."""
    token = _FILES.set(store)
    try:
        yield
    finally:
        _FILES.reset(token)


def active() -> NvmeParams | None:
    return _FILES.get()


def read(store: NvmeParams, i, treedef):
    """Layer ``i``'s weights (``treedef``: the layer loop's tree), read by a callback."""
    rows = jax.pure_callback(store.read_layer, store.row_shapes(), i)
    return jax.tree.unflatten(treedef, rows)
