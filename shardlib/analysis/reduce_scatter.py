"""The CPU backend's spelling of reduce-scatter: an all-reduce each device then slices.

GSPMD partitions "sum partial results, keep my shard" as all-reduce + dynamic-slice; the
GPU and TPU pipelines then fuse the pair into one reduce-scatter, the CPU pipeline does not
(REFERENCE.md). So on simulated CPU devices Megatron-SP's reduce-scatters appear as
all-reduces and their wire bytes as 2(N-1)/N instead of (N-1)/N of the buffer. This module
finds those pairs in the optimized HLO so that reports can show what a GPU would run:
``gpu_collectives(hlo_text, mesh)`` lists a program's collectives (as ``explain`` does)
with those pairs relabelled as reduce-scatters.

The test is structural and per result (tuple element): every use of it (through
get-tuple-element) is a dynamic-slice, or a fusion that dynamic-slices it, keeping 1/N of
its elements.
"""

from __future__ import annotations

import dataclasses
import re

import shardlib.analysis.attribute as attribute
import shardlib.analysis.hlo as hlo
from shardlib.analysis.collective import collective_op
from shardlib.analysis.report import CollectiveOp, ring_wire_bytes


def _users(computation: hlo.Computation) -> dict[str, list[hlo.Instruction]]:
    users: dict[str, list[hlo.Instruction]] = {}
    for inst in computation.instructions:
        for operand in inst.operands:
            users.setdefault(operand, []).append(inst)
    return users


def _slices_to(user: hlo.Instruction, elements: int, n: int, module: hlo.HloModule) -> bool:
    """Does ``user`` keep 1/n of an operand of ``elements`` elements via dynamic-slice?"""
    kept = elements // n
    if user.opcode == "dynamic-slice":
        return user.arrays[0].elements == kept
    if user.opcode != "fusion":
        return False
    called = re.search(r"calls=%?([\w.\-]+)", user.attrs)
    body = module.computations.get(called.group(1)) if called else None
    if body is None:
        return False
    params = {i.name for i in body.instructions if i.opcode == "parameter"}
    types = body.types()
    return any(
        i.opcode == "dynamic-slice"
        and i.operands
        and i.operands[0] in params
        and hlo.parse_type(types[i.operands[0]])[0].elements == elements
        and i.arrays[0].elements == kept
        for i in body.instructions
    )


def _group_size(inst: hlo.Instruction, num_devices: int) -> int:
    groups = hlo.parse_replica_groups(inst.attrs, num_devices) or [[0]]
    return max(len(g) for g in groups)


def cpu_reduce_scatters(text: str) -> dict[str, tuple[hlo.ArrayType, ...]]:
    """The all-reduces some of whose results each device keeps only 1/N of: name -> those
    results (tuple elements), the part a GPU runs as a reduce-scatter.

    Judged element by element: XLA's combiner fuses a gradient that FSDP slices with values
    every device keeps whole (the loss scalar, a replicated bias) into one tuple all-reduce,
    and on GPU the reduce-scatter is formed before that fusion, so the gradient is still
    scattered there; only the whole-kept elements stay an all-reduce.
    """
    module = hlo.parse_module(text)
    found = {}
    for computation in module.computations.values():
        users = _users(computation)
        for inst in computation.instructions:
            if inst.opcode not in ("all-reduce", "all-reduce-start"):
                continue
            n = _group_size(inst, module.num_devices)
            if n <= 1:
                continue
            direct = users.get(inst.name, [])
            if inst.opcode == "all-reduce-start":  # async pair: the done op carries the value
                direct = [u for d in direct for u in users.get(d.name, [])]
            arrays = inst.arrays
            uses: dict[int, list] = {i: [] for i in range(len(arrays))}  # element -> its users
            whole = False  # the tuple itself is used: no element is known to be sliced
            for user in direct:
                if user.opcode == "get-tuple-element":
                    index = int(re.search(r"index=(\d+)", user.attrs).group(1))
                    uses[index] += users.get(user.name, [])
                elif len(arrays) == 1:
                    uses[0].append(user)
                else:
                    whole = True
            sliced = tuple(
                arrays[i]
                for i, its in uses.items()
                if its and all(_slices_to(u, arrays[i].elements, n, module) for u in its)
            )
            if sliced and not whole:
                found[inst.name] = sliced
    return found


def as_gpu_runs(
    ops: list[CollectiveOp], scatters: dict[str, tuple[hlo.ArrayType, ...]]
) -> list[CollectiveOp]:
    """``ops`` with the sliced part of each all-reduce in ``scatters`` as a reduce-scatter;
    the rest of a partly sliced one (a fused scalar, a replicated bias) stays an all-reduce,
    a row of its own with the same name."""
    out = []
    for op in ops:
        sliced = scatters.get(op.name, ()) if op.kind == "all-reduce" else ()
        if not sliced:
            out.append(op)
            continue
        part = min(sum(a.bytes for a in sliced), op.buffer_bytes)
        tensors = sum(1 for a in sliced if a.elements > 1)
        out.append(
            dataclasses.replace(
                op,
                kind="reduce-scatter",
                buffer_bytes=part,
                wire_bytes=ring_wire_bytes("reduce-scatter", part, op.group_size),
                fused_tensors=tensors if op.fused_tensors and tensors >= 2 else 0,
            )
        )
        rest = op.buffer_bytes - part
        if rest > 0:
            left = op.fused_tensors - tensors if op.fused_tensors else 0
            out.append(
                dataclasses.replace(
                    op,
                    buffer_bytes=rest,
                    wire_bytes=ring_wire_bytes("all-reduce", rest, op.group_size),
                    fused_tensors=left if left >= 2 else 0,
                )
            )
    return out


def gpu_collectives(text: str, mesh) -> list[CollectiveOp]:
    """Collectives of compiled HLO ``text`` on ``mesh``, all-reduce + slice as reduce-scatter.

    ``explain`` reports the same list as ``LayoutReport.gpu_collectives``.
    """
    module = hlo.parse_module(text)
    multipliers, _ = hlo.call_multipliers(module)
    shape, names = tuple(mesh.shape.values()), tuple(mesh.shape)
    frames = attribute.stack_frames(text)
    ops = [
        collective_op(raw, shape, names, module, frames)
        for raw in hlo.collectives(module, multipliers)
    ]
    return as_gpu_runs(ops, cpu_reduce_scatters(text))
