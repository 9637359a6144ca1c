"""A picture of a sharded array: which device holds which tile, in mesh-axis words.

``jax.debug.visualize_array_sharding`` draws rank-1 and rank-2 arrays with device ids. When
debugging a layout one wants more: the mesh axes each dim is split over ("dim 0 (batch)
split 8 ways over data x fsdp"), the axes it is replicated over, rank-3 activations, and
abstract inputs (``jax.ShapeDtypeStruct`` with a sharding) so a 70B layout can be looked at
without allocating it. ``show_sharding`` returns a ``ShardingPicture``: plain data that
renders as an image in a notebook, as coloured text in a terminal (rich), and as a
matplotlib ``Figure`` on request (``picture.figure()``).

Everything is derived from ``sharding.devices_indices_map(shape)``, which every JAX sharding
implements without touching data; the mesh axes come from the spec of a NamedSharding, or
are inferred from the device grid when the sharding is not named (e.g. an XLA-chosen one).
"""

from __future__ import annotations

import io
import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from shardlib.core.errors import ShardingError


@dataclass(frozen=True)
class DimSplit:
    """How one dim of the array is cut."""

    dim: int
    """Position of the dim in the array's shape."""
    size: int
    """Length of the dim."""
    name: str | None
    """Logical name given by the caller (``"batch"``), if any."""
    axes: tuple[str, ...]
    """Mesh axes the dim is split over, major first (empty when whole or unknown)."""
    ways: int
    """Number of distinct pieces along the dim."""

    @property
    def label(self) -> str:
        return f"dim {self.dim}" + (f" ({self.name})" if self.name else "")

    def describe(self) -> str:
        what = f"{self.label} [{self.size}]"
        if self.ways == 1:
            return f"{what}: whole" + (f" (over {_join(self.axes)} of size 1)" if self.axes else "")
        over = f" over {_join(self.axes)}" if self.axes else ""
        return f"{what}: split {self.ways} ways{over}, {self.size // self.ways} per tile"

    def short(self) -> str:
        if self.ways == 1:
            return f"{self.label} [{self.size}] whole"
        over = f" over {_join(self.axes)}" if self.axes else ""
        return f"{self.label} [{self.size}] ÷{self.ways}{over}"


@dataclass(frozen=True)
class Tile:
    """One distinct piece of the array and the devices that hold a copy of it."""

    bounds: tuple[tuple[int, int], ...]
    """(start, stop) per dim."""
    devices: tuple[int, ...]
    """Ids of the devices holding this tile (more than one when replicated)."""


@dataclass(frozen=True)
class ShardingPicture:
    """Which device holds which tile of an array; render with ``figure()`` or print it."""

    shape: tuple[int, ...]
    dtype: str
    spec: str
    """The PartitionSpec as text, or the sharding's type when it is not named."""
    dims: tuple[DimSplit, ...]
    replicated_over: tuple[str, ...]
    """Mesh axes (size > 1) along which every tile is copied."""
    copies: int
    """Devices holding each tile."""
    tiles: tuple[Tile, ...]
    mesh_axes: tuple[tuple[str, int], ...]
    """(name, size) of the mesh, outermost first; empty when no mesh is known."""
    mesh_device_ids: tuple[int, ...]
    """Device ids in the mesh's flat (row-major) order."""
    title: str = ""

    def tile_of(self, device_id: int) -> int:
        """Index into ``tiles`` of the tile a device holds."""
        for i, tile in enumerate(self.tiles):
            if device_id in tile.devices:
                return i
        raise KeyError(f"device {device_id} holds no tile of this array")

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.tiles[0].bounds) if self.tiles else ()

    def describe(self) -> list[str]:
        """The picture in words: header, one line per dim, replication, what a device holds."""
        mesh = " × ".join(f"{n}={s}" for n, s in self.mesh_axes) or "no named mesh"
        devices = sum(len(t.devices) for t in self.tiles)
        head = f"{self.dtype}{list(self.shape)} on {mesh} ({devices} devices), spec {self.spec}"
        lines = [f"{self.title}: {head}" if self.title else head]
        lines += [d.describe() for d in self.dims]
        if self.replicated_over:
            lines.append(
                f"replicated over {_join(self.replicated_over)}: {self.copies} copies of each tile"
            )
        elif self.copies > 1:
            lines.append(f"replicated: {self.copies} copies of each tile")
        else:
            lines.append("not replicated: every device holds a different tile")
        whole, held = math.prod(self.shape), math.prod(self.shard_shape)
        if held == whole:
            frac = "all"
        elif held and whole % held == 0:
            frac = f"1/{whole // held}"
        else:
            frac = f"{held / max(whole, 1):.1%}"
        lines.append(f"each device holds {list(self.shard_shape)}: {frac} of the array")
        return lines

    def __str__(self) -> str:
        return "\n".join(self.describe())

    def __rich__(self):
        from shardlib.analysis.picture_draw import rich_picture

        return rich_picture(self)

    def figure(self, max_panels: int = 8):
        """A matplotlib Figure: the array's tiles (one panel per slice of leading dims),
        the device mesh coloured by the tile each device holds, and the description."""
        from shardlib.analysis.picture_draw import draw_figure

        return draw_figure(self, max_panels=max_panels)

    def _repr_png_(self) -> bytes:
        """Notebooks display the picture as an image without pyplot's global state."""
        buf = io.BytesIO()
        self.figure().savefig(buf, format="png", dpi=90, bbox_inches="tight")
        return buf.getvalue()


def _join(axes: tuple[str, ...]) -> str:
    return "×".join(axes)


def _spec_axes(entry: Any) -> tuple[str, ...] | None:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
        return entry
    return None  # UNCONSTRAINED and friends: infer from the tiles instead


def _infer_axes(coords: np.ndarray, index: np.ndarray, names: tuple, sizes: tuple) -> tuple:
    """Mesh axes whose coordinates determine ``index`` (row-major over the axes, major first).

    ``coords`` [devices, mesh axes], ``index`` [devices]: the tile number along one dim.
    """
    used = [a for a in range(len(names)) if sizes[a] > 1]
    deps = []
    for a in used:
        others = [b for b in used if b != a]
        groups: dict[tuple, set] = {}
        for c, i in zip(coords, index, strict=True):
            groups.setdefault(tuple(c[others]), set()).add(int(i))
        if any(len(v) > 1 for v in groups.values()):
            deps.append(a)
    for order in itertools.permutations(deps):
        linear = np.zeros(len(index), dtype=np.int64)
        for a in order:
            linear = linear * sizes[a] + coords[:, a]
        if np.array_equal(linear, index):
            return tuple(names[a] for a in order)
    return ()


def sharding_picture(
    x: Any,
    sharding: Any = None,
    *,
    mesh: Mesh | None = None,
    names: tuple[str | None, ...] | None = None,
    title: str = "",
) -> ShardingPicture:
    """Describe how ``x`` is laid out; nothing is allocated or moved.

    ``x`` is a ``jax.Array``, a ``jax.ShapeDtypeStruct`` with a sharding, or a shape tuple.
    ``sharding`` overrides ``x.sharding``; a ``PartitionSpec`` needs ``mesh``. ``mesh`` names
    the axes of a sharding that is not a NamedSharding. ``names`` are logical dim names.
    """
    shape = tuple(int(s) for s in (x if isinstance(x, tuple | list) else x.shape))
    dtype = str(np.dtype(x.dtype)) if hasattr(x, "dtype") else ""
    sharding = getattr(x, "sharding", None) if sharding is None else sharding
    if isinstance(sharding, PartitionSpec):
        if mesh is None:
            raise ShardingError(
                f"show_sharding: got PartitionSpec {sharding} without a mesh. "
                "Fix: pass mesh=..., or a NamedSharding."
            )
        sharding = NamedSharding(mesh, sharding)
    if sharding is None:
        raise ShardingError(
            f"show_sharding: the {dtype}{list(shape)} input has no sharding. Fix: pass "
            "sharding=NamedSharding(mesh, spec) (a ShapeDtypeStruct needs sharding=...)."
        )
    if names is not None and len(names) != len(shape):
        raise ShardingError(
            f"show_sharding: names {tuple(names)} has {len(names)} entries but the array has "
            f"rank {len(shape)}. Fix: give one logical name (or None) per dim."
        )
    if isinstance(sharding, NamedSharding):
        mesh = sharding.mesh

    index_map = sharding.devices_indices_map(shape)
    bounds_of = {
        dev.id: tuple(sl.indices(n)[:2] for sl, n in zip(idx, shape, strict=True))
        for dev, idx in index_map.items()
    }
    holders: dict[tuple, list[int]] = {}
    for dev_id, bounds in sorted(bounds_of.items()):
        holders.setdefault(bounds, []).append(dev_id)
    tiles = tuple(Tile(b, tuple(ids)) for b, ids in sorted(holders.items()))
    starts = [sorted({b[d][0] for b in holders}) for d in range(len(shape))]

    axis_names = tuple(mesh.axis_names) if mesh is not None else ()
    axis_sizes = tuple(mesh.devices.shape) if mesh is not None else ()
    flat_ids = tuple(int(d.id) for d in mesh.devices.flat) if mesh is not None else ()
    in_mesh = mesh is not None and set(flat_ids) == set(bounds_of)
    coords = np.array(np.unravel_index(np.arange(len(flat_ids)), axis_sizes)).T if in_mesh else None
    named = isinstance(sharding, NamedSharding)
    spec = list(sharding.spec) if named else []
    spec += [None] * (len(shape) - len(spec))

    dims = []
    for d, size in enumerate(shape):
        axes = _spec_axes(spec[d]) if named else None
        if axes is None and in_mesh:
            index = np.array([starts[d].index(bounds_of[i][d][0]) for i in flat_ids])
            axes = _infer_axes(coords, index, axis_names, axis_sizes)
        name = names[d] if names is not None else None
        dims.append(DimSplit(d, size, name, tuple(axes or ()), len(starts[d])))

    split = {a for dim in dims for a in dim.axes}
    replicated = tuple(
        n for n, s in zip(axis_names, axis_sizes, strict=True) if s > 1 and n not in split
    )
    if isinstance(sharding, NamedSharding):
        spec_text = "P(" + ", ".join(repr(e) for e in sharding.spec) + ")"
    else:
        spec_text = type(sharding).__name__
    return ShardingPicture(
        shape=shape,
        dtype=dtype,
        spec=spec_text,
        dims=tuple(dims),
        replicated_over=replicated if in_mesh else (),
        copies=len(tiles[0].devices) if tiles else 0,
        tiles=tiles,
        mesh_axes=tuple(zip(axis_names, axis_sizes, strict=True)) if in_mesh else (),
        mesh_device_ids=flat_ids if in_mesh else (),
        title=title,
    )


def show_sharding(
    x: Any,
    sharding: Any = None,
    *,
    mesh: Mesh | None = None,
    names: tuple[str | None, ...] | None = None,
    title: str = "",
) -> ShardingPicture:
    """Picture which device holds which tile of ``x`` (see ``sharding_picture``).

    In a notebook the returned picture shows as an image; in a terminal print it with
    ``rich.print(picture)``; ``picture.figure()`` gives the matplotlib Figure.
    """
    return sharding_picture(x, sharding, mesh=mesh, names=names, title=title)
