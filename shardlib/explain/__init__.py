"""Explain a sharded program without running it: ``explain(fn, *args) -> LayoutReport``.

The report answers the questions one asks of a sharding plan before renting the cluster:
what does each device hold (inputs, their specs and shard shapes, XLA's memory figures), how
much does it compute (FLOPs with loops counted per trip), and what does it send over which
mesh axis (every collective of the optimized HLO, with ring wire bytes). ``fn`` is lowered and
compiled only, so abstract ``jax.ShapeDtypeStruct`` inputs of 7B-sized models on thousands
of simulated devices cost seconds and no memory.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardlib.explain import hlo
from shardlib.explain.report import (
    CollectiveOp,
    LayoutReport,
    MemoryReport,
    TensorLayout,
    format_bytes,
    ring_wire_bytes,
)

__all__ = [
    "CollectiveOp",
    "LayoutReport",
    "MemoryReport",
    "TensorLayout",
    "explain",
    "format_bytes",
]

# memory_analysis() attribute -> report field. Host fields exist only in newer jaxlibs.
_MEMORY_FIELDS = {
    "argument_size_in_bytes": "argument_bytes",
    "output_size_in_bytes": "output_bytes",
    "alias_size_in_bytes": "alias_bytes",
    "temp_size_in_bytes": "temp_bytes",
    "generated_code_size_in_bytes": "generated_code_bytes",
}
_HOST_FIELDS = ("host_argument", "host_output", "host_alias", "host_temp", "host_generated_code")


def explain(
    fn: Callable,
    *args: Any,
    mesh: jax.sharding.Mesh | None = None,
    param_filter: Callable[[str], bool] | None = None,
    **kwargs: Any,
) -> LayoutReport:
    """Lower and compile ``fn(*args, **kwargs)`` and report its per-device layout.

    ``fn`` may be ``jax.jit``-ed (anything with ``.lower``) or a plain callable. ``mesh``
    maps replica groups to axis names; by default the mesh of the first ``NamedSharding``
    among the compiled shardings. ``param_filter(path)`` picks the inputs that count as
    parameters; by default those whose path contains "params", or all inputs if none does.
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    if isinstance(mesh, jax.sharding.Mesh) and hasattr(jax, "set_mesh"):
        with jax.set_mesh(mesh):  # so that bare PartitionSpecs inside fn resolve
            lowered = jitted.lower(*args, **kwargs)
    else:
        lowered = jitted.lower(*args, **kwargs)
    compiled = lowered.compile()
    shardings = jax.tree_util.tree_leaves(compiled.input_shardings)
    mesh = mesh if mesh is not None else _find_mesh(shardings, compiled)
    axes = dict(mesh.shape) if mesh is not None else {}

    tensors = _tensors(fn, compiled, (args, kwargs))
    if param_filter is None:
        has_params = any("params" in t.path for t in tensors)
        param_filter = (lambda p: "params" in p) if has_params else (lambda p: True)
    tensors = [dataclasses.replace(t, is_param=bool(param_filter(t.path))) for t in tensors]
    params = [t for t in tensors if t.is_param]

    module = hlo.parse_module(compiled.as_text())
    multipliers, warnings = hlo.call_multipliers(module)
    mesh_shape = tuple(axes.values()) or (module.num_devices,)
    names = tuple(axes) or ("devices",)
    if int(np.prod(mesh_shape)) != module.num_devices:
        warnings += (
            f"mesh has {int(np.prod(mesh_shape))} devices but the program runs on "
            f"{module.num_devices}: collective axes may be missing",
        )
    ops = [_collective_op(c, mesh_shape, names) for c in hlo.collectives(module, multipliers)]
    memory, memory_warnings = _memory(compiled)
    return LayoutReport(
        mesh_axes=axes,
        platform=_platform(shardings),
        num_devices=module.num_devices,
        tensors=tensors,
        params_count=sum(int(np.prod(t.shape)) for t in params),
        params_bytes=sum(t.bytes for t in params),
        memory=memory,
        flops_per_device=hlo.count_flops(module, multipliers),
        xla_cost_analysis_flops=_xla_flops(compiled),
        collectives=ops,
        warnings=warnings + memory_warnings,
    )


def _find_mesh(shardings: list, compiled) -> jax.sharding.Mesh | None:
    outputs = jax.tree_util.tree_leaves(compiled.output_shardings)
    for sharding in [*shardings, *outputs]:
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


def _platform(shardings: list) -> str:
    for sharding in shardings:
        devices = getattr(sharding, "device_set", None)
        if devices:
            return next(iter(devices)).platform
    return jax.default_backend()


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _arg_names(fn: Callable) -> list[str]:
    try:
        return [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return []


def _path(keys: tuple, arg_names: list[str]) -> str:
    """(SequenceKey(0), SequenceKey(1), DictKey('params'), ...) -> "state.params...".

    ``args_info`` is ``(args, kwargs)``: a positional input is named after ``fn``'s
    parameter where the signature tells (else ``arg<i>``), a keyword input after its key.
    """
    if len(keys) < 2:
        return ".".join(_key_name(k) for k in keys)
    head, rest = keys[1], keys[2:]
    if _key_name(keys[0]) == "0":
        i = int(_key_name(head))
        first = arg_names[i] if i < len(arg_names) else f"arg{i}"
    else:
        first = _key_name(head)
    return ".".join([first, *(_key_name(k) for k in rest)])


def _spec_text(sharding: Any) -> str:
    if sharding is None:
        return "unused"
    if isinstance(sharding, NamedSharding):
        return "P(" + ", ".join(repr(entry) for entry in sharding.spec) + ")"
    return type(sharding).__name__


def _tensors(fn: Callable, compiled, given: tuple) -> list[TensorLayout]:
    """One TensorLayout per input leaf, in ``args_info`` order.

    XLA's chosen input sharding is reported; inputs that the program does not use have none
    (jit prunes them), so the sharding of the value passed in stands in for those.
    """
    infos = jax.tree_util.tree_flatten_with_path(compiled.args_info)[0]
    shardings = jax.tree_util.tree_leaves(compiled.input_shardings, is_leaf=lambda x: x is None)
    passed = jax.tree_util.tree_leaves(given)
    if len(shardings) != len(infos):
        shardings = [None] * len(infos)
    if len(passed) == len(infos):
        shardings = [
            s if s is not None else getattr(p, "sharding", None)
            for s, p in zip(shardings, passed, strict=True)
        ]
    names = _arg_names(fn)
    tensors = []
    for (keys, info), sharding in zip(infos, shardings, strict=True):
        shape = tuple(info.shape)
        itemsize = np.dtype(info.dtype).itemsize
        shard = tuple(sharding.shard_shape(shape)) if sharding is not None else shape
        tensors.append(
            TensorLayout(
                path=_path(keys, names),
                shape=shape,
                dtype=str(np.dtype(info.dtype)),
                spec=_spec_text(sharding),
                shard_shape=shard,
                bytes=int(np.prod(shape)) * itemsize,
                bytes_per_device=int(np.prod(shard)) * itemsize,
                memory_kind=getattr(sharding, "memory_kind", None),
                donated=bool(getattr(info, "donated", False)),
                is_param=False,
            )
        )
    return tensors


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


def _collective_op(raw: hlo.RawCollective, mesh_shape: tuple, names: tuple) -> CollectiveOp:
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
    )


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


def _memory(compiled) -> tuple[MemoryReport, tuple[str, ...]]:
    try:
        stats = compiled.memory_analysis()
    except Exception as e:  # some backends do not implement it
        return MemoryReport(), (f"memory_analysis() failed: {e}",)
    if stats is None:
        return MemoryReport(), ("memory_analysis() returned nothing on this backend",)
    values = {field: int(getattr(stats, attr, 0) or 0) for attr, field in _MEMORY_FIELDS.items()}
    host = {
        f"{name}_bytes": int(getattr(stats, f"{name}_size_in_bytes"))
        for name in _HOST_FIELDS
        if hasattr(stats, f"{name}_size_in_bytes")
    }
    peak = getattr(stats, "peak_memory_in_bytes", None)
    return MemoryReport(**values, peak_bytes=None if peak is None else int(peak), host=host), ()


def _xla_flops(compiled) -> float | None:
    """``cost_analysis()['flops']``; older jaxlibs return a list with one dict per program."""
    try:
        analysis = compiled.cost_analysis()
    except Exception:  # not every backend implements it
        return None
    if isinstance(analysis, list | tuple):
        analysis = analysis[0] if analysis else {}
    flops = (analysis or {}).get("flops")
    return None if flops is None else float(flops)
