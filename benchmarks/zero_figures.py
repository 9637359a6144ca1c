"""ZeRO figures of one compiled train step: model-state bytes and traffic per device.

Compiles the step from abstract shapes (nothing runs) and sets what it holds and sends next
to the ZeRO table of REFERENCE.md (``benchmarks/reference.py``). What is measured and how:

* parameters + optimizer state: the compiled step's inputs, split by the memory kind XLA
  compiled each for (the CPU backend's ``memory_analysis()`` counts pinned-host arguments in
  its argument bytes and leaves its ``host_*`` fields at 0, seen with jax 0.10.2);
* gradients: a transient inside the step, not an input. Its buffer is the shard of the
  gradient layout (the accumulation buffer's), summed over parameters;
* traffic: ring wire bytes of every collective of the optimized HLO. The CPU backend
  all-reduces gradients that GPU/TPU reduce-scatter (REFERENCE.md), so for stages 1-3 the
  "GPU form" counts the all-reduces as reduce-scatters: half their wire bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import numpy as np

from benchmarks.reference import zero_memory, zero_wire
from shardlib.analysis import LayoutReport, explain
from shardlib.parallel.offload import HOST_KINDS


@dataclass(frozen=True)
class ZeroFigures:
    """Per-device bytes of one ZeRO configuration, measured and from the formulas."""

    stage: int
    offload: bool
    devices: int
    """N: the data-parallel degree the state is sharded over."""
    params: int
    """Ψ, counted from the compiled step's parameter inputs."""
    device_state_bytes: int
    """Inputs compiled for device memory: parameters, device-resident optimizer state, batch."""
    host_state_bytes: int
    """Inputs compiled for host memory (the offloaded optimizer state)."""
    grad_bytes: int
    """One device's share of the gradient buffer."""
    wire_bytes: float
    """Ring wire bytes of all collectives, as compiled (CPU)."""
    gpu_wire_bytes: float
    """The same with gradient all-reduces counted as reduce-scatters (stages 1-3)."""
    memory_formula: float
    """ZeRO table, fp32 Adam (4Ψ + 4Ψ + 8Ψ split per stage); offload: no optimizer term."""
    wire_formula: float
    """2Ψ (stages 0-2) or 3Ψ (stage 3) fp32 bytes, ring-exact: times (N-1)/N."""
    report: LayoutReport

    @property
    def device_bytes(self) -> int:
        return self.device_state_bytes + self.grad_bytes

    @property
    def memory_ratio(self) -> float:
        return self.device_bytes / self.memory_formula

    @property
    def wire_ratio(self) -> float:
        return self.gpu_wire_bytes / self.wire_formula


def grad_buffer_bytes(setup) -> int:
    """Bytes one device holds of the gradient buffer, in the setup's gradient layout."""
    total = 0
    for shape, sharding in zip(
        jax.tree.leaves(setup.param_shapes), jax.tree.leaves(setup.grad_shardings), strict=True
    ):
        shard = sharding.shard_shape(tuple(shape.shape))
        total += math.prod(shard) * np.dtype(shape.dtype).itemsize
    return total


def zero_figures(setup, devices: int) -> ZeroFigures:
    """Compile ``setup``'s step and measure it against the ZeRO table (fp32 Adam)."""
    report = explain(
        setup.train_step, setup.abstract_state(), setup.abstract_batch(), mesh=setup.mesh
    )
    host = report.host_argument_bytes
    device = sum(t.bytes_per_device for t in report.tensors if t.memory_kind not in HOST_KINDS)
    totals = report.collective_totals
    wire = sum(v["wire_bytes"] for v in totals.values())
    reduced = totals.get("all-reduce", {}).get("wire_bytes", 0.0)
    stage, offload = setup.plan.data.zero, setup.plan.offload.optimizer
    psi = report.params_count
    return ZeroFigures(
        stage=stage,
        offload=offload,
        devices=devices,
        params=psi,
        device_state_bytes=device,
        host_state_bytes=host,
        grad_bytes=grad_buffer_bytes(setup),
        wire_bytes=wire,
        gpu_wire_bytes=wire - reduced / 2 if stage else wire,
        memory_formula=zero_memory(stage, psi, devices, optimizer_bytes=0 if offload else 8),
        wire_formula=zero_wire(stage, psi, devices),
        report=report,
    )
