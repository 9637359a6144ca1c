"""From a collective in the HLO to a row of the report: mesh axes, group, wire bytes, and
what it moves (``attribute``). Shared by ``explain`` and the GPU-form recount
(``reduce_scatter.gpu_collectives``), so that both describe a collective one way.

XLA's all-reduce combiner fuses the data-parallel gradient reductions into one tuple
all-reduce (every gradient of a layer, or of the whole model, at once). Its metadata then
points at one of the many lines involved (an attention projection, say), which reads as if
that line alone asked for it; such a collective is labelled a fused gradient sync with the
number of tensors it carries instead (``fused_tensors``).
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
    module and its stack frames) the input it moves, the line that asked for it and its
    result's shape (what tells apart two ops of one size whose metadata names neither's
    product: a stacked weight's per-layer slice, say)."""
    if raw.kind == "collective-permute":  # axes along which data moves
        axes = _mesh_axes([list(p) for p in raw.pairs], mesh_shape, names)
        group_size = _largest_cycle(raw.pairs)
    else:
        axes = _mesh_axes([list(g) for g in raw.groups], mesh_shape, names)
        group_size = max((len(g) for g in raw.groups), default=1)
    inst = _instruction(module, raw) if module else None
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
        source=attribute.source(inst.attrs, frames or {}) if inst else "",
        fused_tensors=fused_gradients(raw.kind, raw.op_name, inst.arrays) if inst else 0,
        shapes=tuple(a.dims for a in inst.arrays) if inst else (),
    )


def fused_gradients(kind: str, op_name: str, arrays: tuple) -> int:
    """How many gradients (arrays of more than one element) a fused reduction carries, or 0
    when it is not one: a tuple all-reduce (or reduce-scatter) of two or more of them, made
    by the backward pass (JAX names its ops ``transpose(jvp(...))``). Scalars riding along
    (the loss, a norm) are not counted."""
    if kind not in ("all-reduce", "reduce-scatter") or "transpose(" not in op_name:
        return 0
    tensors = sum(1 for a in arrays if a.elements > 1)
    return tensors if tensors >= 2 else 0


def _instruction(module: hlo.HloModule, raw: hlo.RawCollective) -> hlo.Instruction | None:
    for inst in module.computations[raw.computation].instructions:
        if inst.name == raw.name:
            return inst
    return None


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
