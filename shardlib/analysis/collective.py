"""From a collective in the HLO to a row of the report: mesh axes, group, wire bytes, and
what it moves (``attribute``). Shared by ``explain`` and the GPU-form recount
(``reduce_scatter.gpu_collectives``), so that both describe a collective one way.
"""

from __future__ import annotations

import numpy as np

import shardlib.analysis.attribute as attribute
import shardlib.analysis.hlo as hlo
from shardlib.analysis.report import CollectiveOp, ring_wire_bytes


def _mesh_axes(groups: list, mesh_shape: tuple[int, ...], names: tuple[str, ...]) -> tuple:
    """Mesh axes along which members of the device ``groups`` (partition indices) differ.

    Partition i runs on ``mesh.devices.flat[i]`` (jit compiles with the mesh's flat device
    order as its device assignment), so its coordinates are ``unravel_index(i, mesh shape)``
    whatever the physical device ids are.
    """
    spanned: set[int] = set()
    for size in {len(g) for g in groups}:
        ids = np.array([g for g in groups if len(g) == size])  # [groups, members]
        if ids.size == 0 or ids.max() >= int(np.prod(mesh_shape)):
            continue
        for axis, coords in enumerate(np.unravel_index(ids, mesh_shape)):
            if (coords != coords[:, :1]).any():
                spanned.add(axis)
    return tuple(names[a] for a in sorted(spanned))


def collective_op(
    raw: hlo.RawCollective,
    mesh_shape: tuple,
    names: tuple,
    module: hlo.HloModule | None = None,
    frames: dict[int, str] | None = None,
) -> CollectiveOp:
    """A raw collective on the mesh: its axes, group size and wire bytes, and (given the
    module and its stack frames) the input it moves and the line that asked for it."""
    if raw.kind == "collective-permute":  # axes along which data moves
        axes = _mesh_axes([list(p) for p in raw.pairs], mesh_shape, names)
        group_size = _largest_cycle(raw.pairs)
    else:
        axes = _mesh_axes([list(g) for g in raw.groups], mesh_shape, names)
        group_size = max((len(g) for g in raw.groups), default=1)
    return CollectiveOp(
        name=raw.name,
        kind=raw.kind,
        axes=axes,
        group_size=group_size,
        count=raw.count,
        buffer_bytes=raw.buffer_bytes,
        wire_bytes=ring_wire_bytes(raw.kind, raw.buffer_bytes, group_size),
        op_name=raw.op_name,
        tensor=attribute.moved_input(module, raw.computation, raw.name) if module else "",
        source=attribute.source(_attrs(module, raw), frames or {}) if module else "",
    )


def _attrs(module: hlo.HloModule, raw: hlo.RawCollective) -> str:
    for inst in module.computations[raw.computation].instructions:
        if inst.name == raw.name:
            return inst.attrs
    return ""


def _largest_cycle(pairs: tuple[tuple[int, int], ...]) -> int:
    """Devices in the largest connected set of a permute's pairs (4 for a ring of 4)."""
    parent: dict[int, int] = {}

    def root(x: int) -> int:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x

    for source, target in pairs:
        parent[root(source)] = root(target)
    sizes: dict[int, int] = {}
    for x in list(parent):
        sizes[root(x)] = sizes.get(root(x), 0) + 1
    return max(sizes.values(), default=1)
