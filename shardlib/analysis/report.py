"""The layout report: what each device holds, computes and sends for one compiled step.

Everything is a frozen dataclass of plain numbers and strings so that a report can be
compared, serialised (``to_json``) and printed (``render``) long after the compiled program
is gone. Figures are per device and come from the CPU backend when simulated devices are
used: REFERENCE.md explains why CPU wire bytes are an upper bound for GPU/TPU.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:  # peak.py renders with this module's format_bytes
    from shardlib.analysis.peak import Peak

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: float | None) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    if n is None:
        return "-"
    size, unit = float(n), 0
    while abs(size) >= 1024 and unit < len(_UNITS) - 1:
        size, unit = size / 1024, unit + 1
    return f"{int(size)} B" if unit == 0 else f"{size:.1f} {_UNITS[unit]}"


def format_count(n: float | None) -> str:
    """Large counts with SI prefixes: 1.2e12 -> '1.20 T'."""
    if n is None:
        return "-"
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {prefix}"
    return f"{n:g}"


def ring_wire_bytes(kind: str, buffer_bytes: int, group_size: int) -> float:
    """Bytes each device sends for one execution, bandwidth-optimal (ring), per REFERENCE.md.

    all-reduce 2(N-1)/N M; all-gather, reduce-scatter, all-to-all (N-1)/N M;
    collective-permute M. A group of one device sends nothing.
    """
    if kind == "collective-permute":
        return float(buffer_bytes) if group_size > 1 else 0.0
    if group_size <= 1:
        return 0.0
    factor = (group_size - 1) / group_size
    return (2 * factor if kind == "all-reduce" else factor) * buffer_bytes


@dataclass(frozen=True)
class TensorLayout:
    """One input leaf of the compiled function and how it is laid out on the mesh."""

    path: str  # dotted path, e.g. "state.params.blocks.attn.wq"
    shape: tuple[int, ...]
    dtype: str
    spec: str  # the PartitionSpec as text, or the sharding's repr when it is not named
    shard_shape: tuple[int, ...]  # what one device holds
    bytes: int  # the whole (logical) array
    bytes_per_device: int
    memory_kind: str | None  # "device", "pinned_host", ... where the sharding says
    donated: bool
    is_param: bool  # counted in params_count / params_bytes (``explain``'s ``params=``)


@dataclass(frozen=True)
class MemoryReport:
    """``compiled.memory_analysis()`` per device, in bytes.

    ``total_bytes = argument + output - alias + temp``: inputs and outputs live together at
    the end of the step unless an output reuses (aliases) a donated input, plus XLA's scratch.
    Generated code and host-side (offloaded) buffers are reported apart from the total.
    """

    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    generated_code_bytes: int = 0
    peak_bytes: int | None = None  # XLA's own peak estimate, where the backend provides one
    host: dict[str, int] = field(default_factory=dict)  # host_argument_bytes, ... if present

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    def to_json(self) -> dict:
        return {
            "argument_bytes": self.argument_bytes,
            "output_bytes": self.output_bytes,
            "alias_bytes": self.alias_bytes,
            "temp_bytes": self.temp_bytes,
            "generated_code_bytes": self.generated_code_bytes,
            "peak_bytes": self.peak_bytes,
            "total_bytes": self.total_bytes,
            **self.host,
        }


@dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction of the optimized HLO (async start/done counted once)."""

    name: str  # HLO instruction name
    kind: str  # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
    axes: tuple[str, ...]  # mesh axes its groups span (permute: along which pairs move)
    group_size: int
    count: int  # executions per step: product of enclosing while trip counts
    buffer_bytes: int  # per execution, the full unsharded M of REFERENCE.md
    wire_bytes: float  # per execution and device, ring formula
    op_name: str = ""  # the JAX op it came from (HLO metadata)
    tensor: str = ""  # the input it moves (an argument path), where the HLO traces it back
    source: str = ""  # where in the user's code: "model.py:42 in Block.__call__"
    fused_tensors: int = 0  # gradients one fused (tuple) reduction carries; 0: not one
    # dims of each array of its result as the HLO prints it (an async start: operands, then
    # results; a reduce-scatter recounted from an all-reduce: the all-reduce's, unscattered)
    shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def moves(self) -> str:
        """What to show for "what is this": the input moved, else a fused gradient sync (its
        metadata names one of many lines), else the line, else the op."""
        if not self.tensor and self.fused_tensors:
            return f"fused gradient sync ({self.fused_tensors} tensors)"
        return self.tensor or self.source or self.op_name

    @property
    def total_buffer_bytes(self) -> int:
        return self.buffer_bytes * self.count

    @property
    def total_wire_bytes(self) -> float:
        return self.wire_bytes * self.count

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "axes": list(self.axes),
            "total_buffer_bytes": self.total_buffer_bytes,
            "total_wire_bytes": self.total_wire_bytes,
        }


def _totals(ops: list[CollectiveOp], key) -> dict[str, dict[str, float]]:
    totals: dict[str, dict[str, float]] = {}
    for op in ops:
        t = totals.setdefault(key(op), {"count": 0, "buffer_bytes": 0, "wire_bytes": 0.0})
        t["count"] += op.count
        t["buffer_bytes"] += op.total_buffer_bytes
        t["wire_bytes"] += op.total_wire_bytes
    return totals


def axes_key(axes: tuple[str, ...]) -> str:
    """How a set of mesh axes is written as a key: "data", "data,tensor", "-" for none."""
    return ",".join(axes) if axes else "-"


@dataclass(frozen=True)
class LayoutReport:
    """Per-device layout, memory, FLOPs and communication of one compiled step.

    ``flops_per_device`` walks the HLO and counts every loop body once per trip;
    ``xla_cost_analysis_flops`` is XLA's own figure, which on CPU counts a while body once,
    so for a scanned model only the former scales with the number of layers.
    """

    mesh_axes: dict[str, int]
    platform: str
    num_devices: int
    tensors: list[TensorLayout]
    params_count: int
    params_bytes: int
    memory: MemoryReport
    flops_per_device: int
    xla_cost_analysis_flops: float | None
    collectives: list[CollectiveOp]
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    """What the caller adds about the program (the trainer: the attention kernel it chose)."""
    gpu_collectives: list[CollectiveOp] = field(default_factory=list)
    """The same collectives as GPU and TPU run them: the CPU backend's all-reduce + slice
    pairs counted as the reduce-scatters they become there (``reduce_scatter``)."""
    peak: Peak | None = None
    """What is live at the memory peak (``explain(..., peak=True)``; ``analysis.peak``)."""

    @property
    def host_argument_bytes(self) -> int:
        """Per device, the arguments whose sharding places them in host memory. The CPU
        backend's ``memory_analysis`` counts them with the device arguments (jax 0.10)."""
        from shardlib.parallel.offload import HOST_KINDS

        return sum(t.bytes_per_device for t in self.tensors if t.memory_kind in HOST_KINDS)

    @property
    def collective_totals(self) -> dict[str, dict[str, float]]:
        """Per collective kind: executions, buffer bytes and wire bytes per step."""
        return _totals(self.collectives, lambda op: op.kind)

    @property
    def collective_totals_by_axis(self) -> dict[str, dict[str, float]]:
        """The same totals keyed by the mesh axes spanned (``axes_key``)."""
        return _totals(self.collectives, lambda op: axes_key(op.axes))

    @property
    def gpu_collective_totals(self) -> dict[str, dict[str, float]]:
        """``collective_totals`` of the GPU form (``gpu_collectives``)."""
        return _totals(self.gpu_collectives, lambda op: op.kind)

    def to_json(self) -> dict:
        return {
            "mesh": {
                "axes": dict(self.mesh_axes),
                "platform": self.platform,
                "num_devices": self.num_devices,
            },
            "params": {"count": self.params_count, "bytes": self.params_bytes},
            "memory_per_device": self.memory.to_json(),
            "memory_peak": self.peak.to_json() if self.peak is not None else None,
            "flops_per_device": self.flops_per_device,
            "xla_cost_analysis_flops": self.xla_cost_analysis_flops,
            "collective_totals": self.collective_totals,
            "collective_totals_by_axis": self.collective_totals_by_axis,
            "collectives": [op.to_json() for op in self.collectives],
            "gpu_collective_totals": self.gpu_collective_totals,
            "tensors": [
                {**asdict(t), "shape": list(t.shape), "shard_shape": list(t.shard_shape)}
                for t in self.tensors
            ],
            "warnings": list(self.warnings),
            "notes": list(self.notes),
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def render(self, console: Console | None = None) -> None:
        """Print the summary, tensors, memory and collectives tables."""
        console = console or Console()
        for table in (
            self._summary_table(),
            self._tensor_table(),
            self._memory_table(),
            *([self.peak.table()] if self.peak is not None else []),
            self._collective_table(),
            self._totals_table(),
        ):
            console.print(table)
        for note in self.notes:
            console.print(note, highlight=False, soft_wrap=True)
        for warning in self.warnings:
            console.print(f"[yellow]warning:[/yellow] {warning}")

    def print(self) -> None:
        self.render()

    # Tables stay readable from 80 columns up: numbers and collective kinds never wrap (a
    # kind cut to "all-gat…" reads as nothing), long text folds onto more lines.
    def _summary_table(self) -> Table:
        table = Table(title="Layout report (per device)", show_header=False)
        table.add_column(no_wrap=True)
        table.add_column(overflow="fold")
        mesh = " x ".join(f"{name}={size}" for name, size in self.mesh_axes.items())
        table.add_row("mesh", f"{mesh or '-'} ({self.num_devices} {self.platform} devices)")
        table.add_row(
            "params", f"{format_count(self.params_count)} ({format_bytes(self.params_bytes)})"
        )
        table.add_row("FLOPs / device", format_count(self.flops_per_device))
        table.add_row("XLA cost_analysis FLOPs", format_count(self.xla_cost_analysis_flops))
        return table

    def _tensor_table(self) -> Table:
        table = Table(title="Inputs")
        table.add_column("path", overflow="fold", ratio=3)
        for col in ("shape", "dtype", "spec", "shard shape"):
            table.add_column(col, overflow="fold", ratio=1)
        for col in ("bytes", "per device"):
            table.add_column(col, justify="right", no_wrap=True)
        for t in self.tensors:
            table.add_row(
                t.path,
                str(list(t.shape)),
                t.dtype,
                t.spec,
                str(list(t.shard_shape)),
                format_bytes(t.bytes),
                format_bytes(t.bytes_per_device),
            )
        return table

    def _memory_table(self) -> Table:
        table = Table(title="Memory per device")
        table.add_column("part", no_wrap=True)
        table.add_column("bytes", justify="right", no_wrap=True)
        for part, value in self.memory.to_json().items():
            table.add_row(part.removesuffix("_bytes"), format_bytes(value))
        return table

    def _collective_table(self) -> Table:
        """One row per collective; "moves" is the input it moves, else the line of code."""
        table = Table(title="Collectives (per device, per step)")
        table.add_column("kind", no_wrap=True)
        table.add_column("axes", overflow="fold")
        for col in ("group", "count", "total wire"):
            table.add_column(col, justify="right", no_wrap=True)
        table.add_column("moves", overflow="fold", ratio=1, min_width=12)
        for op in self.collectives:  # per execution: total wire / count (to_json has both)
            table.add_row(
                op.kind,
                axes_key(op.axes),
                str(op.group_size),
                str(op.count),
                format_bytes(op.total_wire_bytes),
                op.moves,
            )
        return table

    def _totals_table(self) -> Table:
        table = Table(title="Collective totals per step")
        table.add_column("by", no_wrap=True)
        table.add_column("key", no_wrap=True)
        for col in ("count", "buffer", "wire"):
            table.add_column(col, justify="right", no_wrap=True)
        for by, totals in (
            ("kind", self.collective_totals),
            ("axes", self.collective_totals_by_axis),
            ("GPU form", self.gpu_collective_totals),
        ):
            for key, t in totals.items():
                table.add_row(
                    by,
                    key,
                    str(t["count"]),
                    format_bytes(t["buffer_bytes"]),
                    format_bytes(t["wire_bytes"]),
                )
        return table
