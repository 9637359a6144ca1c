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
import tempfile
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardlib.analysis import attribute, hlo, hlo_flops
from shardlib.analysis import peak as peak_dump
from shardlib.analysis.collective import collective_op
from shardlib.analysis.reduce_scatter import as_gpu_runs, cpu_reduce_scatters, gpu_collectives
from shardlib.analysis.report import (
    CollectiveOp,
    LayoutReport,
    MemoryReport,
    TensorLayout,
    format_bytes,
)
from shardlib.core.errors import ShardingError

__all__ = [
    "CollectiveOp",
    "LayoutReport",
    "MemoryReport",
    "TensorLayout",
    "explain",
    "format_bytes",
    "gpu_collectives",
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
    params: Any = None,
    param_filter: Callable[[str], bool] | None = None,
    peak: bool = False,
    **kwargs: Any,
) -> LayoutReport:
    """Lower and compile ``fn(*args, **kwargs)`` and report its per-device layout.

    ``fn`` may be ``jax.jit``-ed (anything with ``.lower``) or a plain callable. ``mesh``
    maps replica groups to axis names; by default the mesh of the first ``NamedSharding``
    among the compiled shardings.

    Which inputs are the parameters (``params_count``, ``params_bytes``, ``is_param``):
    ``params=`` the tree of parameters as passed in (e.g. ``params=state["params"]``; its
    leaves are matched by identity), or an argument path prefix (``params="state.weights"``);
    or ``param_filter(path)``. Without either, the inputs under a path component named
    exactly ``params``; if there is none, every input, with a warning that says so.

    ``peak=True``: also what is live at the memory peak and where it falls (``report.peak``,
    ``analysis.peak``), read off XLA's heap simulation, which XLA writes when the module is
    dumped: the step is compiled once, with a dump into a temporary directory.
    """
    jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
    if isinstance(mesh, jax.sharding.Mesh) and hasattr(jax, "set_mesh"):
        with jax.set_mesh(mesh):  # so that bare PartitionSpecs inside fn resolve
            lowered = jitted.lower(*args, **kwargs)
    else:
        lowered = jitted.lower(*args, **kwargs)
    live = None
    if peak:
        with tempfile.TemporaryDirectory() as directory:
            compiled = lowered.compile(peak_dump.dump_options(directory))
            live = peak_dump.read(directory)
    else:
        compiled = lowered.compile()
    shardings = jax.tree_util.tree_leaves(compiled.input_shardings)
    mesh = mesh if mesh is not None else _find_mesh(shardings, compiled)
    axes = dict(mesh.shape) if mesh is not None else {}

    tensors = _tensors(fn, compiled, (args, kwargs))
    marks, warnings = _param_marks(tensors, (args, kwargs), params, param_filter)
    tensors = [dataclasses.replace(t, is_param=m) for t, m in zip(tensors, marks, strict=True)]
    param_list = [t for t in tensors if t.is_param]

    text = compiled.as_text()
    module = hlo.parse_module(text)
    multipliers, loop_warnings = hlo.call_multipliers(module)
    warnings += loop_warnings
    mesh_shape = tuple(axes.values()) or (module.num_devices,)
    names = tuple(axes) or ("devices",)
    if int(np.prod(mesh_shape)) != module.num_devices:
        warnings += (
            f"mesh has {int(np.prod(mesh_shape))} devices but the program runs on "
            f"{module.num_devices}: collective axes may be missing",
        )
    frames = attribute.stack_frames(text)
    ops = [
        collective_op(c, mesh_shape, names, module, frames)
        for c in hlo.collectives(module, multipliers)
    ]
    memory, memory_warnings = _memory(compiled)
    if live is not None:
        live = dataclasses.replace(live, allocated_bytes=memory.total_bytes)
    elif peak:
        memory_warnings += ("peak=True: XLA wrote no live ranges for this backend's dump",)
    return LayoutReport(
        mesh_axes=axes,
        platform=_platform(shardings),
        num_devices=module.num_devices,
        tensors=tensors,
        params_count=sum(int(np.prod(t.shape)) for t in param_list),
        params_bytes=sum(t.bytes for t in param_list),
        memory=memory,
        flops_per_device=hlo_flops.count_flops(module, multipliers),
        xla_cost_analysis_flops=_xla_flops(compiled),
        collectives=ops,
        warnings=warnings + memory_warnings,
        gpu_collectives=as_gpu_runs(ops, cpu_reduce_scatters(text)),
        peak=live,
    )


def _param_marks(
    tensors: list[TensorLayout], given: tuple, params: Any, param_filter
) -> tuple[list[bool], tuple[str, ...]]:
    """Which inputs are parameters (see ``explain``), and a warning when it was a guess."""
    if isinstance(params, str):
        prefix = params.rstrip(".")
        marks = [t.path == prefix or t.path.startswith(prefix + ".") for t in tensors]
        if not any(marks):
            raise ShardingError(
                f"explain: params={params!r} matches no input path (inputs: "
                f"{', '.join(t.path for t in tensors[:4])}, ...). Fix: pass an input path "
                "prefix such as 'state.params', or params=<the parameter tree>."
            )
        return marks, ()
    if params is not None:
        ids = {id(leaf) for leaf in jax.tree_util.tree_leaves(params)}
        passed = jax.tree_util.tree_leaves(given)
        if len(passed) != len(tensors) or not ids & {id(p) for p in passed}:
            raise ShardingError(
                "explain: none of the params= leaves is among the arguments. Fix: pass the "
                "very tree given to fn (params=state['params']) or a path prefix "
                "(params='state.params')."
            )
        return [id(p) in ids for p in passed], ()
    if param_filter is not None:
        return [bool(param_filter(t.path)) for t in tensors], ()
    marks = ["params" in t.path.split(".") for t in tensors]
    if any(marks):
        return marks, ()
    warning = (
        "no params= given and no input path has a 'params' component: every input is "
        "counted as a parameter. Fix: explain(fn, *args, params=<the parameter tree>)"
    )
    return [True] * len(tensors), (warning,) if len(tensors) > 1 else ()


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
