"""The cost model: per-device memory and step time of a plan, as a sum of strategy terms.

``estimate(workload, plan, cluster)`` asks each term in ``terms/`` for its share and adds
them up. Time is compute (the terms' FLOPs at the rate this plan's matmul shapes reach on
the cluster) plus the collectives that cannot hide behind compute plus the pipeline bubble
plus host transfers plus the optimizer update; ``planner.throughput`` is that model (rate,
links, overlap), calibrated on published runs (docs/throughput_calibration.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import shardlib.planner.cost.throughput as throughput
from shardlib.core.errors import ShardingError
from shardlib.core.workload import Workload
from shardlib.parallel.plan import ParallelPlan
from shardlib.planner.candidate import REMAT, PlanView
from shardlib.planner.cost.coefficients import COEFFICIENTS
from shardlib.planner.cost.terms import (
    SEARCH_AXES,
    context,
    dp,
    expert,
    fsdp,
    model,
    offload,
    pipeline,
    state,
    tensor,
)
from shardlib.planner.cost.terms.base import Comm, Context, Contribution
from shardlib.planner.inputs.cluster import Cluster

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
    """Fraction of peak FLOP/s this plan's matmul shapes reach (``planner.throughput``)."""
    compute_parts: dict[str, float] = field(default_factory=dict)
    """``compute_s`` shared out by part (each matmul of the blocks, ``head``,
    ``elementwise``) in the proportions of one micro-batch's forward."""
    update_s: float = 0.0
    """The optimizer update's pass over the state (``throughput.update_seconds``)."""

    @property
    def memory_bytes(self) -> float:
        return sum(v for k, v in self.memory.items() if not k.startswith("host"))

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


def check(workload: Workload, plan: ParallelPlan, cluster: Cluster | None) -> None:
    """Shape constraints before costing; ShardingError names what does not divide, or
    the setting the cost model does not describe."""
    w, p = workload, PlanView(plan)
    if -1 in p.sizes.values():
        raise ShardingError(
            f"plan {p.mesh_text()}: an axis is -1. Fix: plan.with_devices(n) before estimating."
        )
    unmodelled = _unmodelled(p)
    if unmodelled:
        raise ShardingError(
            f"plan {p.mesh_text()}: the cost model does not describe {unmodelled}. Fix: "
            "drop it to estimate the rest, or compile the plan (planner.validate)."
        )
    if cluster is not None and p.size != cluster.num_devices:
        raise ShardingError(f"plan {p.mesh_text()} uses {p.size} of {cluster.num_devices} devices")
    if w.global_batch % (p.batch_ways * p.microbatches):
        raise ShardingError(
            f"plan {p.mesh_text()}: batch {w.global_batch} does not split into "
            f"{p.microbatches} micro-batches over {p.batch_ways} replicas"
        )
    for axis in SEARCH_AXES:  # each strategy's own shape checks (its term's declaration)
        if axis.check is not None and p.sizes.get(str(axis.axis), 1) > 1:
            axis.check(w, p)


_DEFAULT = ParallelPlan()


def _unmodelled(p: PlanView) -> str:
    """The first setting of ``p`` outside what the terms cost ("" when there is none)."""
    plan, default = p.plan, _DEFAULT
    settings = {
        "gradient accumulation with pipeline stages": p.stage > 1 and p.accumulation > 1,
        "ZeRO-3 over data (use an fsdp axis)": p.zero > 2,
        f"remat={p.remat}": p.remat not in REMAT,
        "offload.params": plan.offload.params,
        "tensor.sequence_parallel or 2D/3D tensor axes": plan.tensor != default.tensor
        or any(a in p.sizes for a in ("tensor2", "tensor3")),
        "context attention other than ring": plan.context.attention != default.context.attention
        or plan.context.load_balance != default.context.load_balance,
        "attention_impl=cudnn across a context axis": p.fused_attention and p.context > 1,
        f"expert.dispatch={plan.expert.dispatch}": plan.expert != default.expert,
    }
    return next((what for what, present in settings.items() if present), "")


def collective_seconds(comm: Comm, cluster: Cluster, plan: ParallelPlan) -> float:
    """Seconds of one collective on its link (``throughput.collective_seconds``)."""
    return throughput.collective_seconds(comm, cluster, plan.mesh.axes)


def contributions(ctx: Context, cluster: Cluster | None) -> list[Contribution]:
    """Every term's share, in one visible place (the order does not matter: they add)."""
    held = state.state(ctx)
    host_bw = cluster.host_link_bw if cluster else 25e9
    return [
        held,
        model.flops(ctx),
        model.activations(ctx, pipeline.layer_sets_saved(ctx), pipeline.head_batch(ctx)),
        dp.gradient_reduction(ctx),
        fsdp.fsdp(ctx),
        tensor.tensor(ctx),
        context.context(ctx),
        expert.expert(ctx),
        pipeline.pipeline(ctx),
        offload.offload(ctx, held.memory["optimizer"], host_bw),
    ]


@dataclass(frozen=True)
class Program:
    """What runs for a plan: the terms that say what it computes, holds and moves, and the
    HBM traffic of its elementwise kernels. The planner costs shardlib's own program
    (``SHARDLIB``); the calibration costs the published runs' programs on the same hardware
    model (``planner.megatron``), so that differences of program are not fitted as
    differences of hardware."""

    terms: Callable[[Context, Cluster | None], list[Contribution]]
    traffic: throughput.BlockTraffic = throughput.LLAMA_TRAFFIC


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
    """Predict one plan. ``cluster=None`` predicts memory and bytes only (no time)."""
    check(workload, plan, cluster)
    calib = COEFFICIENTS if calib is None else calib
    ctx = Context(workload, plan, backend, PlanView(plan), calib)
    parts = program.terms(ctx, cluster)
    memory: dict[str, float] = defaultdict(float)
    comms: list[Comm] = []
    flops = host_s = 0.0
    notes: list[str] = []
    for part in parts:
        for k, v in part.memory.items():
            memory[k] += v
        comms.extend(part.comms)
        flops += part.flops
        host_s += part.seconds
        notes.extend(part.notes)
    memory["runtime"] = ctx.calib["fixed_bytes"]
    if cluster is None:
        return Estimate(plan, dict(memory), tuple(comms), flops, 0, 0, 0, 0, 0, 0, 0, 0, True)
    rate = throughput.compute_rate(ctx, cluster, program.traffic)
    # the SPMD pipeline computes its bubble (every stage, every iteration): those FLOPs are
    # in ``flops`` (as in the compiled program) and are reported as bubble time, not compute
    bubble_s = pipeline.extra_flops(ctx)[0] / rate.flops_per_s
    compute_s = flops / rate.flops_per_s - bubble_s
    total_s = sum(rate.seconds.values())
    windows = throughput.overlap_windows(rate, compute_s)
    exposed_s, comm_s = throughput.exposed_seconds(
        comms, cluster, plan.mesh.axes, windows, staged=ctx.p.stage > 1
    )
    update_s = throughput.update_seconds(ctx, cluster)
    step_s = compute_s + exposed_s + bubble_s + host_s + update_s
    mfu = workload.model_flops / (cluster.num_devices * cluster.peak_flops * step_s)
    total = sum(v for k, v in memory.items() if not k.startswith("host"))
    return Estimate(
        plan=plan,
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
        compute_parts={k: compute_s * v / total_s for k, v in rate.seconds.items()},
        update_s=update_s,
    )
