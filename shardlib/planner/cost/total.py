"""The cost model: per-device memory and step time of a plan, as a sum of strategy terms.

``estimate(workload, plan, cluster)`` asks each registered term (``terms.TERMS``) for its
share and adds them up; it names no strategy. Time is compute (the terms' FLOPs at the
rate this plan's matmul shapes reach on the cluster) plus the collectives that cannot hide
behind compute plus the bubble plus host transfers plus the optimizer update;
``cost.throughput`` is that model (rate, links, overlap), calibrated on published runs
(docs/throughput_calibration.md).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import shardlib.planner.cost.throughput as throughput
from shardlib.core.errors import ShardingError
from shardlib.core.workload import Workload
from shardlib.parallel.context.choice import Device
from shardlib.parallel.plan import ParallelPlan
from shardlib.planner.candidate import PlanView
from shardlib.planner.cost import kernels
from shardlib.planner.cost.coefficients import COEFFICIENTS, for_block
from shardlib.planner.cost.terms import SEARCH_AXES, TERMS
from shardlib.planner.cost.terms.base import Comm, Contribution, Step
from shardlib.planner.inputs.cluster import Cluster

COMPUTE_EXTRAS = ("saved activations", "kernel launches")
"""Parts of ``Estimate.compute_parts`` beyond the forward's rate: the saved activations' HBM
round trip (``throughput.saved_seconds``) and the kernels' launch gaps (``launch_seconds``)."""
MEMORY_HEADROOM = 0.92
"""Usable fraction of device memory (allocator fragmentation, NCCL and runtime buffers)."""


@dataclass(frozen=True)
class Estimate:
    """Predicted per-device figures for one plan on one cluster."""

    plan: ParallelPlan
    memory: dict[str, float]
    """Bytes per device by part."""
    comms: tuple[Comm, ...]
    flops: float
    """FLOPs per device per step (recompute included)."""
    compute_s: float
    comm_s: float
    """Collective time, all of it (exposed or not)."""
    exposed_comm_s: float
    bubble_s: float
    host_s: float
    step_s: float
    mfu: float
    """Model FLOPs (6Ψ + attention, no recompute) / (devices x peak x step time)."""
    tokens_per_s: float
    fits: bool
    notes: tuple[str, ...] = field(default=())
    compute_efficiency: float = 0.0
    """Fraction of peak FLOP/s this plan's matmul shapes reach (``planner.cost.throughput``)."""
    compute_parts: dict[str, float] = field(default_factory=dict)
    """``compute_s`` shared out by part (each matmul of the blocks, ``head``,
    ``elementwise``) in the proportions of one micro-batch's forward."""
    update_s: float = 0.0
    """The optimizer update's pass over the state (``throughput.update_seconds``)."""

    @property
    def memory_bytes(self) -> float:
        """Bytes per device in device memory (not ``host: ...`` or ``nvme: ...`` parts)."""
        return sum(v for k, v in self.memory.items() if not k.startswith(("host", "nvme")))

    @property
    def nvme_bytes(self) -> float:
        """Bytes per device kept on the NVMe tier (``nvme: ...`` parts)."""
        return sum(v for k, v in self.memory.items() if k.startswith("nvme"))

    @property
    def host_bytes(self) -> float:
        """Bytes per device kept in host memory (``host: ...`` parts)."""
        return sum(v for k, v in self.memory.items() if k.startswith("host"))

    @property
    def wire_bytes(self) -> float:
        return sum(c.wire_bytes for c in self.comms)

    def wire_by_axes(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for c in self.comms:
            out[",".join(c.axes)] += c.wire_bytes
        return dict(out)

    def wire_by_strategy(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for c in self.comms:
            out[c.strategy] += c.wire_bytes
        return dict(out)


def check(
    workload: Workload, plan: ParallelPlan, cluster: Cluster | None, view: PlanView | None = None
) -> None:
    """Shape constraints before costing; ShardingError names what does not divide, or
    the setting the cost model does not describe (``view``: the plan's, when made)."""
    w, view = workload, PlanView(plan) if view is None else view
    if -1 in view.sizes.values():
        raise ShardingError(
            f"plan {view.mesh_text()}: an axis is -1. Fix: plan.with_devices(n) before estimating."
        )
    unmodelled = unmodelled_setting(view)
    if unmodelled:
        raise ShardingError(
            f"plan {view.mesh_text()}: the cost model does not describe {unmodelled}. Fix: "
            "drop it to estimate the rest, or compile the plan (planner.validate)."
        )
    if cluster is not None and view.size != cluster.num_devices:
        raise ShardingError(
            f"plan {view.mesh_text()} uses {view.size} of {cluster.num_devices} devices"
        )
    batch_ways = view.ways("batch")
    slices = view["stage"] > 1 and view.schedule == "terapipe"  # m cuts the sequence
    if w.global_batch % (batch_ways * (1 if slices else view.microbatches)):
        raise ShardingError(
            f"plan {view.mesh_text()}: batch {w.global_batch} does not split into "
            f"{view.microbatches} micro-batches over {batch_ways} replicas"
        )
    for axis in SEARCH_AXES:  # each strategy's own shape checks (its term's declaration)
        if axis.check is not None and view[str(axis.axis)] > 1:
            axis.check(w, view)


def unmodelled_setting(view: PlanView) -> str:
    """The first setting of the plan outside what the terms cost ("" when there is none):
    each term says it of its own section (``Term.unmodelled``)."""
    return next((what for term in TERMS if (what := term.unmodelled(view))), "")


def collective_seconds(comm: Comm, cluster: Cluster, plan: ParallelPlan) -> float:
    """Seconds of one collective on its link (``throughput.collective_seconds``)."""
    return throughput.collective_seconds(comm, cluster, plan.mesh.axes)


def contributions(step: Step) -> list[Contribution]:
    """Every term's share (``terms.TERMS``; the order does not matter: they add)."""
    return [term.cost(step) for term in TERMS]


def replacing(step: Step, strategies: set[str]) -> list[Contribution]:
    """shardlib's terms with the collectives of ``strategies`` taken out, their FLOPs and
    memory kept: the base a published program (``planner.calibrate``) adds its own
    traffic for those strategies to."""
    return [
        dataclasses.replace(
            part, comms=tuple(c for c in part.comms if c.strategy not in strategies)
        )
        for part in contributions(step)
    ]


@dataclass(frozen=True)
class Program:
    """What runs for a plan: the terms that say what it computes, holds and moves, and the
    HBM traffic of its elementwise kernels. The planner costs shardlib's own program
    (``SHARDLIB``); the calibration costs the published runs' programs on the same hardware
    model (``planner.calibrate.megatron``), so that differences of program are not fitted as
    differences of hardware."""

    terms: Callable[[Step], list[Contribution]]
    traffic: kernels.BlockTraffic = kernels.LLAMA_TRAFFIC
    attention: kernels.AttentionKernel = kernels.CUDNN_ATTENTION
    """Its fused attention kernel (where the plan fuses attention)."""


SHARDLIB = Program(contributions)


def estimate(
    workload: Workload,
    plan: ParallelPlan,
    cluster: Cluster | None = None,
    *,
    backend: str = "gpu",
    calib: dict | None = None,
    program: Program = SHARDLIB,
) -> Estimate:
    """Predict one plan. ``cluster=None`` predicts memory and bytes only (no time).

    ``attention_impl=auto`` is costed as the trainer would run it on the cluster's devices
    (``backend="cpu"``: on the CPU backend, as compiled validation runs it); the estimate
    keeps the plan as given, so a written plan still says ``auto``."""
    device = Device("cpu") if backend == "cpu" else cluster.device if cluster else Device("gpu")
    picked = plan.attention_choice(workload, device)
    given, plan = plan, plan.with_attention(picked)
    view = PlanView(plan)
    check(workload, plan, cluster, view)
    calib = for_block(COEFFICIENTS if calib is None else calib, workload.block_kind)
    step = Step(workload, plan, backend, view, TERMS, calib, cluster)
    parts = program.terms(step)
    memory: dict[str, float] = defaultdict(float)
    comms: list[Comm] = []
    flops = idle_flops = host_s = 0.0
    notes: list[str] = []
    if given.context.attention_impl == "auto":
        notes.append(f"costed with {picked.describe()}")
    for part in parts:
        for k, v in part.memory.items():
            memory[k] += v
        comms.extend(part.comms)
        flops += part.flops
        idle_flops += part.idle_flops
        host_s += part.seconds
        notes.extend(part.notes)
    memory["runtime"] = step.calib["fixed_bytes"]
    if cluster is None:
        return Estimate(given, dict(memory), tuple(comms), flops, 0, 0, 0, 0, 0, 0, 0, 0, True)
    rate = throughput.compute_rate(step, cluster, program.traffic, program.attention)
    # a schedule that computes its bubble (the SPMD pipeline: every stage, every iteration)
    # has those FLOPs in ``flops`` (as in the compiled program): reported as bubble time
    bubble_s = idle_flops / rate.flops_per_s
    rate_s = flops / rate.flops_per_s - bubble_s  # the FLOPs the terms count, at this rate
    # saved activations' HBM round trip and kernel launch gaps: compute-side time the
    # matmul roofline does not see (``throughput.saved_seconds``, ``launch_seconds``)
    saved, launches = COMPUTE_EXTRAS
    extra = {
        saved: throughput.saved_seconds(step, cluster),
        launches: throughput.launch_seconds(step, cluster),
    }
    extra_s = sum(extra.values())
    # a bubble slot is a whole micro-batch's work: its share of the extras too
    bubble_s *= (1 + extra_s / rate_s) if rate_s > 0 else 1
    compute_s = rate_s + extra_s
    total_s = sum(rate.seconds.values())
    windows = throughput.overlap_windows(rate, compute_s, view.remat == "full")
    exposed_s, comm_s = throughput.exposed_seconds(comms, cluster, plan.mesh.axes, windows, view)
    update_s = throughput.update_seconds(step, cluster)
    step_s = compute_s + exposed_s + bubble_s + host_s + update_s
    mfu = workload.model_flops / (cluster.num_devices * cluster.peak_flops * step_s)
    total = sum(v for k, v in memory.items() if not k.startswith(("host", "nvme")))
    return Estimate(
        plan=given,
        memory=dict(memory),
        comms=tuple(comms),
        flops=flops,
        compute_s=compute_s,
        comm_s=comm_s,
        exposed_comm_s=exposed_s,
        bubble_s=bubble_s,
        host_s=host_s,
        step_s=step_s,
        mfu=mfu,
        tokens_per_s=workload.tokens / step_s,
        fits=total <= MEMORY_HEADROOM * cluster.memory_bytes,
        notes=tuple(dict.fromkeys(notes)),
        compute_efficiency=rate.efficiency,
        compute_parts={k: rate_s * v / total_s for k, v in rate.seconds.items()} | extra,
        update_s=update_s,
    )
