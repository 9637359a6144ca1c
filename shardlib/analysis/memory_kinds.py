"""Device and host bytes of a compiled step, where the backend does not tell them apart.

A GPU's ``compiled.memory_analysis()`` reports host buffers apart (``host_argument_size_in_
bytes``, ...). The CPU backend (jax 0.10) does not: host and device are the same memory,
every ``host_*`` field is 0, and its host-offload lowering drops the transfers (a
``device_put`` to the device is a no-op copy, so the program updates the host buffer in
place). What a GPU would hold is then counted from two places, per device:

* ``host_bytes``: the entry computation's arguments and results whose layout carries
  memory space 5 (``S(5)``, host) in the optimized HLO's ``entry_computation_layout``; a
  result aliased to a donated argument (``input_output_alias``) is counted once;
* ``staged_bytes``: the device copies of host data the program asks for, read from its
  jaxpr, whose values carry their memory space (``float32<host>``): every ``device_put``
  from a host value to device memory. Transfers at one level are live together; a loop's
  (``scan``/``while``) transfers are live for one trip, so a loop adds the most one trip
  stages, once. Bytes are the destination sharding's shard where the transfer names one,
  else the value split as the weight of its dims is (``weight_splits``, where the caller
  passes the parameters; else whole: exact on one device, an upper bound on a mesh).

* ``host_temp_bytes``: host-memory values the program makes besides its results (the
  jaxpr again): the gradients of offloaded weights, which the backward loop writes to host
  memory layer by layer (the transpose of the forward's fetch), one device's share as for
  ``staged_bytes``.

``device_bytes = compiled total - host_bytes - host_temp_bytes + staged_bytes``: what XLA's
buffers need (``memory_analysis``'s total) less what lives in host memory, plus the copies
a GPU makes and the CPU elides. ``loop_staged`` lists what each loop trip stages (a layer's
weights in the forward and backward loops under parameter offload). Moving the whole
optimizer state to the device for the update stages all of it (the device total barely
falls, as the H200 measured); streaming it per layer (``parallel.offload_stream``) stages
one layer.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import jax

HOST_SPACE = "S(5)"
_SHAPE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]\{([^}]*)\}")
_BITS = {"pred": 8, "s4": 4, "u4": 4}
LOOPS = ("scan", "while")
Splits = dict[tuple[int, ...], int]
"""How many ways a weight is split over the devices, by its dims and by one layer's."""


@dataclass(frozen=True)
class MemoryByKind:
    """Bytes per device of one compiled step, by memory kind (module docstring)."""

    compiled_total: int
    """``memory_analysis()``: arguments + outputs - aliased + temporaries (all kinds on CPU)."""
    host_bytes: int
    """Entry arguments and results in host memory (``S(5)``), aliased ones once."""
    staged_bytes: int
    """The most bytes of host data copied to the device at one time (from the jaxpr)."""
    host_temp_bytes: int = 0
    """Host-memory values the program makes besides its results (from the jaxpr)."""
    separated: bool = False
    """The backend reported host memory apart: ``compiled_total`` is the device's alone."""

    @property
    def device_bytes(self) -> int:
        if self.separated:
            return self.compiled_total
        return self.compiled_total - self.host_bytes - self.host_temp_bytes + self.staged_bytes

    def formula(self) -> str:
        if self.separated:
            return "device = memory_analysis total (host reported apart)"
        return (
            f"device = total {self.compiled_total:,} - host {self.host_bytes:,} "
            f"- host temporaries {self.host_temp_bytes:,} + staged {self.staged_bytes:,} "
            f"= {self.device_bytes:,}"
        )


def _dtype_bytes(dtype: str) -> float:
    if dtype in _BITS:
        return _BITS[dtype] / 8
    bits = re.search(r"\d+", dtype)
    return int(bits.group()) / 8 if bits else 4


def _shapes(text: str) -> list[tuple[int, bool]]:
    """``(bytes, in host memory)`` of each array shape in an HLO layout string, in order."""
    out = []
    for dtype, dims, layout in _SHAPE.findall(text):
        n = math.prod(int(d) for d in dims.split(",") if d)
        out.append((int(n * _dtype_bytes(dtype)), HOST_SPACE in layout))
    return out


def _block(text: str, key: str) -> str:
    """The balanced ``{...}`` that follows ``key=`` in the HLO module's header line."""
    start = text.index(key + "=") + len(key) + 1
    depth = 0
    for j in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start + 1 : j]
    raise ValueError(f"unbalanced {key} in the HLO header")


def host_entry_bytes(hlo_text: str) -> int:
    """Per device, entry arguments + results in memory space 5, aliased results once."""
    header = hlo_text.splitlines()[0]
    params, results = _block(header, "entry_computation_layout").split("->", 1)
    aliased = set()
    if "input_output_alias=" in header:
        aliased = {int(m) for m in re.findall(r"\{(\d+)\}:", _block(header, "input_output_alias"))}
    host_in = sum(b for b, host in _shapes(params) if host)
    host_out = sum(b for i, (b, host) in enumerate(_shapes(results)) if host and i not in aliased)
    return host_in + host_out


def _sub_jaxprs(params: dict):
    for value in params.values():
        for v in value if isinstance(value, tuple | list) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def _to_device(dst) -> bool:
    if isinstance(dst, jax.sharding.Sharding):
        return dst.memory_kind in (None, "device")
    return dst == jax.memory.Space.Device


def _staged_bytes(dst, aval, splits: Splits | None) -> int:
    if isinstance(dst, jax.sharding.Sharding):
        return math.prod(dst.shard_shape(aval.shape)) * aval.dtype.itemsize
    return _nbytes(aval, splits)


def weight_splits(params) -> Splits:
    """The split of each weight (whole elements over one device's), keyed by its dims and,
    for the stacked layers, by the dims of one layer. The host values the offload paths
    make (a weight's gradient sent to host, a layer's row of it read back for the update)
    have that weight's layout, which their avals do not carry (they read replicated): whole,
    a gradient split over tensor 4 was counted four times (64 devices, llama-small, data 16
    x tensor 4, ZeRO-1 with the optimizer offloaded: 16.0 MB of host temporaries where a
    device writes 4.0). Where two weights share dims the smaller split is kept."""
    out: Splits = {}
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if sharding is None or not leaf.shape:
            continue
        split = math.prod(leaf.shape) // max(1, math.prod(sharding.shard_shape(leaf.shape)))
        for key in (tuple(leaf.shape), tuple(leaf.shape[1:])):
            out[key] = min(out.get(key, split), split)
    return out


def staged_bytes(jaxpr, splits: Splits | None = None) -> int:
    """The most host bytes copied to the device at one time (module docstring)."""
    level, nested, loop = 0, 0, 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            for var, dst in zip(eqn.invars, eqn.params["devices"], strict=True):
                space = getattr(getattr(var.aval, "memory_space", None), "name", "")
                if space == "Host" and _to_device(dst):
                    level += _staged_bytes(dst, var.aval, splits)
        for sub in _sub_jaxprs(eqn.params):
            if eqn.primitive.name in LOOPS:
                loop = max(loop, staged_bytes(sub, splits))
            else:
                nested += staged_bytes(sub, splits)
    return level + nested + loop


def loop_staged(jaxpr, where: str = "") -> list[tuple[str, int]]:
    """``(loop, bytes)`` per loop: the host bytes one trip copies to the device, loops in
    program order (``scan``/``while`` with the ``op_name`` of their source where known)."""
    out = []
    for eqn in jaxpr.eqns:
        for sub in _sub_jaxprs(eqn.params):
            if eqn.primitive.name in LOOPS:
                name = eqn.source_info.name_stack or eqn.primitive.name
                out.append((f"{where}{name}:{eqn.primitive.name}", staged_bytes(sub)))
            else:
                out.extend(loop_staged(sub, where))
    return out


def _is_host(var) -> bool:
    return getattr(getattr(var.aval, "memory_space", None), "name", "") == "Host"


def _nbytes(aval, splits: Splits | None = None) -> int:
    """One device's bytes of ``aval``: whole, or split as the weight of its dims is."""
    whole = math.prod(aval.shape) * aval.dtype.itemsize
    if not splits:
        return whole
    split = splits.get(tuple(aval.shape)) or splits.get(tuple(aval.shape[1:])) or 1
    return whole // split


def host_temp_bytes(jaxpr, splits: Splits | None = None) -> int:
    """Bytes of host-memory values the program makes that are not its results: e.g. the
    gradients of offloaded weights, written to host memory layer by layer by the backward
    loop. A ``device_put`` of a value already in host memory is a no-op, not a buffer;
    loop bodies' own values are a trip's and are not counted (their results are)."""
    results = {id(v) for v in jaxpr.outvars}
    total = 0
    for eqn in jaxpr.eqns:
        noop = eqn.primitive.name == "device_put" and all(_is_host(v) for v in eqn.invars)
        if not noop:
            total += sum(_nbytes(v.aval, splits) for v in eqn.outvars
                         if _is_host(v) and id(v) not in results)  # fmt: skip
        if eqn.primitive.name not in LOOPS:
            total += sum(host_temp_bytes(sub, splits) for sub in _sub_jaxprs(eqn.params))
    return total


def live(jaxpr):
    """``jaxpr`` without the values nothing reads, inside loops too: XLA drops them, so they
    are no buffer (``offload_grads``'s gradient sink, a host value only AD reads the type of)."""
    from jax._src.interpreters.partial_eval import dce_jaxpr  # no public DCE (jax <= 0.12)

    return dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))[0]


def memory_by_kind(jitted, *args) -> MemoryByKind:
    """Compile ``jitted`` for ``args`` (arrays or ShapeDtypeStructs with shardings) and
    count its bytes per device by memory kind."""
    traced = jitted.trace(*args)
    jaxpr = live(traced.jaxpr.jaxpr)
    compiled = traced.lower().compile()
    stats = compiled.memory_analysis()
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes
             - stats.alias_size_in_bytes + stats.temp_size_in_bytes)  # fmt: skip
    host_reported = stats.host_argument_size_in_bytes + stats.host_output_size_in_bytes
    return MemoryByKind(
        compiled_total=total,
        host_bytes=host_reported or host_entry_bytes(compiled.as_text()),
        staged_bytes=staged_bytes(jaxpr),
        host_temp_bytes=host_temp_bytes(jaxpr),
        separated=host_reported > 0,
    )
