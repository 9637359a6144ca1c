"""ZeRO-Infinity's NVMe tier: the optimizer state lives in files, one layer visits the device.

Host memory holds the state under ZeRO-Offload (``offload_stream``); past that, DeepSpeed's
ZeRO-Infinity keeps it on NVMe (``offload_optimizer.device: nvme``, ``nvme_path``). Here
every parameter-shaped state tensor is one file under ``nvme_path`` (a ``numpy.memmap``:
the page cache and the kernel's readahead do the I/O), and the update walks the stacked
layers in Python: read layer ``i``'s rows from the files into pinned host buffers
(``jax.device_put`` to ``pinned_host``), run one jitted call that moves them to the device,
runs optax's ``tx.update`` on that layer (``offload_stream.layer_update``, the same code as
the in-memory streamed update) and returns the new rows to pinned host memory, then write
them back. JAX dispatches asynchronously, so the next layer's read overlaps the current
layer's update. The parameters that are not stacked go through one more call, whole.

Every step reads and writes each state byte exactly once (``io``: the counters a test
holds to the state's size). Scalars (step counts) stay in memory and are saved with the
files (``save``/``restore``: the files copied, the scalars in ``scalars.npz``), which is
what an exact resume needs. The state must be whole on each device (no ZeRO split of the
state: one device, or data parallelism with ``zero=0``): each file is the whole tensor.

The stacked weights can live in files too (``offload_nvme_params``, ZeRO-Infinity's
``offload_param.device: nvme``): ``update_files`` then reads each layer's weights with its
state rows and writes both back (``train.nvme``: ``offload.nvme_params``).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.parallel.offload import HOST_MEMORY
from shardlib.parallel.offload_stream import (
    BLOCKS,
    OTHER,
    REST,
    STACKED,
    clipper,
    grad_norm,
    layer_row,
    layer_update,
    rest_update,
    state_kinds,
)

SCALARS = "scalars.npz"


@dataclass
class Io:
    """Bytes moved between the files and host memory since the last ``reset``."""

    read: int = 0
    written: int = 0


class NvmeOptimizerState:
    """optax's state for ``params``, its parameter-shaped tensors in files under ``path``."""

    def __init__(self, tx: optax.GradientTransformation, params: dict, path, mesh, *,
                 clip_norm: float = 0.0):  # fmt: skip
        self.tx, self.path, self.clip_norm = tx, Path(path), clip_norm
        abstract = jax.eval_shape(tx.init, params)
        self.leaves, self.treedef = jax.tree.flatten(abstract)
        self.kinds = state_kinds(tx, abstract, params)
        self.layers = jax.tree.leaves(params[BLOCKS])[0].shape[0]
        self.host = NamedSharding(mesh, P(), memory_kind=HOST_MEMORY)
        self.scalars = [None] * len(self.leaves)
        self.files: dict[int, np.memmap] = {}
        self.io = Io()
        self._update_layer = jax.jit(self._layer_call, donate_argnums=3)
        self._update_rest = jax.jit(self._rest_call)
        self._update_file_layer = jax.jit(self._file_layer_call, donate_argnums=(1, 3))
        self._norm = jax.jit(lambda g: grad_norm(g, self.layers))

    @property
    def nbytes(self) -> int:
        """Bytes of the state kept in files (every parameter-shaped tensor)."""
        return sum(int(np.prod(x.shape)) * x.dtype.itemsize
                   for x, k in zip(self.leaves, self.kinds, strict=True) if k != OTHER)  # fmt: skip

    def _open(self, mode: str) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        self.files = {
            j: np.memmap(self.path / f"state{j:03d}.bin", x.dtype, mode, shape=x.shape)
            for j, (x, k) in enumerate(zip(self.leaves, self.kinds, strict=True)) if k != OTHER
        }  # fmt: skip

    @classmethod
    def create(cls, tx, params: dict, path, mesh, **kw) -> NvmeOptimizerState:
        """New files holding ``tx.init(params)``, written one layer at a time."""
        self = cls(tx, params, path, mesh, **kw)
        self._open("w+")
        params, init = jax.device_get(params), jax.jit(tx.init)  # numpy rows: free to slice
        stand_in = {k: v for k, v in params.items() if k != BLOCKS}
        rest = jax.tree.leaves(init({**stand_in, BLOCKS: _rows(params[BLOCKS], 0, 0)}))
        for j, k in enumerate(self.kinds):
            if k == REST:
                self.files[j][...] = np.asarray(rest[j])
            elif k == OTHER:  # committed, replicated: as the update's own outputs are
                self.scalars[j] = jax.device_put(rest[j], NamedSharding(mesh, P()))
        for i in range(self.layers):
            rows = jax.tree.leaves(init({**_rows(stand_in, 0, 0),
                                            BLOCKS: _rows(params[BLOCKS], i, i + 1)}))  # fmt: skip
            for j, k in enumerate(self.kinds):
                if k == STACKED:
                    self.files[j][i : i + 1] = np.asarray(rows[j])
        return self

    def _rest_call(self, rest, scalars, grads, params, norm):
        clip = clipper(norm, self.clip_norm)
        rest = [None if r is None else jax.device_put(r, jax.memory.Space.Device) for r in rest]
        new_params, new = rest_update(self.tx, self.treedef, self.kinds, self.leaves, rest,
                                      scalars, grads, params, clip)  # fmt: skip
        host = [jax.device_put(r, jax.memory.Space.Host) if k == REST else None
                for r, k in zip(new, self.kinds, strict=True)]  # fmt: skip
        return new_params, host, [r if k == OTHER else None
                                  for r, k in zip(new, self.kinds, strict=True)]  # fmt: skip

    def _layer_call(self, i, rows, scalars, blocks, grads, norm):
        clip = clipper(norm, self.clip_norm)
        rows = [None if r is None else jax.device_put(r, jax.memory.Space.Device) for r in rows]
        grads_row = jax.tree.map(lambda x: layer_row(x, i), grads[BLOCKS])
        blocks, new = layer_update(self.tx, self.treedef, self.kinds, self.leaves, rows,
                                   scalars, (grads, grads_row), blocks, i, clip)  # fmt: skip
        return blocks, [jax.device_put(r, jax.memory.Space.Host) if k == STACKED else None
                        for r, k in zip(new, self.kinds, strict=True)]  # fmt: skip

    def _file_layer_call(self, i, rows, scalars, weights, grads, norm):
        """Layer ``i`` with its weights a ``[1, ...]`` row read from files (host memory):
        the new weights and state rows, back in host memory."""
        clip = clipper(norm, self.clip_norm)
        to_device = lambda x: jax.device_put(x, jax.memory.Space.Device)  # noqa: E731
        rows = [None if r is None else to_device(r) for r in rows]
        grads_row = jax.tree.map(lambda x: layer_row(x, i), grads[BLOCKS])
        weights, new = layer_update(self.tx, self.treedef, self.kinds, self.leaves, rows,
                                    scalars, (grads, grads_row), jax.tree.map(to_device, weights),
                                    0, clip)  # fmt: skip
        to_host = lambda x: jax.device_put(x, jax.memory.Space.Host)  # noqa: E731
        return jax.tree.map(to_host, weights), [
            to_host(r) if k == STACKED else None for r, k in zip(new, self.kinds, strict=True)
        ]

    def _read(self, kind: str, i: int | None = None) -> list:
        """The ``kind`` tensors (layer ``i``'s rows), in pinned host buffers."""
        out = []
        for j, k in enumerate(self.kinds):
            if k != kind:
                out.append(None)
                continue
            data = np.array(self.files[j] if i is None else self.files[j][i : i + 1])
            self.io.read += data.nbytes
            out.append(jax.device_put(data, self.host))
        return out

    def _write(self, new: list, i: int | None = None) -> None:
        for j, r in enumerate(new):
            if r is None:
                continue
            data = np.asarray(r)
            self.files[j][... if i is None else slice(i, i + 1)] = data
            self.io.written += data.nbytes

    def update(self, grads: dict, params: dict) -> tuple[dict, jax.Array]:
        """``(new_params, grad_norm)``: one optimizer step, the state streamed from the files."""
        norm = self._norm(grads)
        new_params, rest, scalars = self._update_rest(
            self._read(REST), self.scalars, grads, params, norm
        )
        blocks, rows = params[BLOCKS], self._read(STACKED, 0)
        for i in range(self.layers):
            blocks, new_rows = self._update_layer(i, rows, self.scalars, blocks, grads, norm)
            if i + 1 < self.layers:  # the next layer's read overlaps this layer's update
                rows = self._read(STACKED, i + 1)
            self._write(new_rows, i)
        self._write(rest)
        self.scalars = scalars
        for f in self.files.values():
            f.flush()
        return {**new_params, BLOCKS: blocks}, norm

    def update_files(self, grads: dict, rest: dict, weights) -> tuple[dict, jax.Array]:
        """``(new_rest, grad_norm)``: ``update`` with the stacked weights in ``weights``'s
        files (``offload_nvme_params.NvmeParams``): each layer's weights read into pinned
        host memory with its state rows, updated on the device, and written back."""
        norm = self._norm(grads)
        stand_in = {**rest, BLOCKS: grads[BLOCKS]}  # (shapes only: no block is read)
        new_rest, state_rest, scalars = self._update_rest(
            self._read(REST), self.scalars, grads, stand_in, norm
        )
        for i in range(self.layers):
            row = [jax.device_put(r, self.host) for r in weights.read_rows(i)]
            row = jax.tree.unflatten(weights.treedef, row)
            new_row, new_state = self._update_file_layer(
                i, self._read(STACKED, i), self.scalars, row, grads, norm
            )
            weights.write_rows(i, jax.tree.leaves(new_row))
            self._write(new_state, i)
        self._write(state_rest)
        self.scalars = scalars
        for f in self.files.values():
            f.flush()
        weights.flush()
        return {k: v for k, v in new_rest.items() if k != BLOCKS}, norm

    def tree(self):
        """The state as optax's pytree, its parameter-shaped leaves the files themselves
        (``numpy.memmap`` views: nothing read until used), its scalars in memory.

        This is what a checkpoint saves: the same tensors, names and shapes as the in-memory
        run's ``opt_state``, so either run resumes the other's checkpoints. The views change
        with the next ``update``: whoever reads them (orbax's writer) finishes first.
        """
        leaves = [np.asarray(self.files[j]) if k != OTHER else self.scalars[j]
                  for j, k in enumerate(self.kinds)]  # fmt: skip
        return self.treedef.unflatten(leaves)

    @classmethod
    def from_tree(cls, tx, params: dict, path, mesh, tree, **kw) -> NvmeOptimizerState:
        """New files under ``path`` holding ``tree`` (optax's state, restored from a
        checkpoint into host memory), written one tensor at a time."""
        self = cls(tx, params, path, mesh, **kw)
        self._open("w+")
        replicated = NamedSharding(mesh, P())
        for j, (leaf, k) in enumerate(zip(jax.tree.leaves(tree), self.kinds, strict=True)):
            if k == OTHER:
                self.scalars[j] = jax.device_put(leaf, replicated)
            else:
                self.files[j][...] = np.asarray(leaf)
                self.files[j].flush()
        return self

    def save(self, directory) -> None:
        """The files and the scalars, copied to ``directory`` (a checkpoint's)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for f in self.files.values():
            f.flush()
            shutil.copyfile(f.filename, directory / Path(f.filename).name)
        np.savez(directory / SCALARS, *[np.asarray(s) for s in self.scalars if s is not None])

    @classmethod
    def restore(cls, tx, params: dict, path, mesh, directory, **kw) -> NvmeOptimizerState:
        """The state saved in ``directory``, copied into ``path`` and opened there."""
        self = cls(tx, params, path, mesh, **kw)
        self.load(directory)
        return self

    def load(self, directory) -> None:
        """Replace this state by the one saved in ``directory`` (files copied into ``path``)."""
        self.path.mkdir(parents=True, exist_ok=True)
        self.files = {}
        for j, k in enumerate(self.kinds):
            if k != OTHER:
                name = f"state{j:03d}.bin"
                shutil.copyfile(Path(directory) / name, self.path / name)
        self._open("r+")
        saved = iter(np.load(Path(directory) / SCALARS).values())
        self.scalars = [jax.numpy.asarray(next(saved)) if k == OTHER else None
                        for k in self.kinds]  # fmt: skip


def _rows(tree, start: int, stop: int):
    """Rows ``start:stop`` of every leaf (0:0: a zero-size stand-in of the same rank)."""
    return jax.tree.map(lambda x: x[start:stop], tree)
