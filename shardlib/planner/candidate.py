"""The planner's candidates are ``ParallelPlan``s; ``PlanView`` reads the numbers terms need.

A candidate is the very object the trainer runs (``shardlib.parallel.plan.ParallelPlan``), so
what the planner costs, writes and validates is one description with no translation in
between. ``candidate(...)`` builds one from the search's knobs: the mesh axes with size > 1
in ``AXIS_ORDER`` and the sections those knobs set. ``PlanView`` is a read-only lens on a
plan (axis sizes, the micro-batch count whichever section holds it, the schedule in the
trainer's words): it keeps nothing the plan does not say.

Mesh axes are always laid out in ``AXIS_ORDER`` (outermost first), the order of the
``placement`` each planner term declares for its axis (``planner.terms.SEARCH_AXES``). The
last axes vary fastest over device ids and so stay inside a host: tensor parallelism (an
all-reduce on the critical path of every layer) is innermost, then context, expert and FSDP
(per-layer traffic that overlaps compute), then pipeline stages and data parallelism, whose
traffic is a once-per-step gradient reduction or small point-to-point sends that tolerate a
slow link.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

from shardlib.core.mesh import Axis, MeshSpec
from shardlib.parallel.data import DataParallel
from shardlib.parallel.offload import Offload
from shardlib.parallel.pipeline.gpipe import PipelineParallel
from shardlib.parallel.plan import ParallelPlan
from shardlib.parallel.remat import Remat
from shardlib.planner.cost.terms import SEARCH_AXES

AXIS_ORDER: tuple[Axis, ...] = tuple(a.axis for a in sorted(SEARCH_AXES, key=lambda a: a.placement))
"""The searched mesh axes, outermost first (by their terms' ``placement``)."""
BATCH_AXES: tuple[str, ...] = tuple(str(a.axis) for a in SEARCH_AXES if a.splits_batch)
"""Axes whose every index gets its own rows of the batch."""


def batch_ways(sizes: Mapping[str, int]) -> int:
    """Ways the batch is split over the mesh ``sizes`` (absent axes: 1)."""
    return math.prod(sizes.get(a, 1) for a in BATCH_AXES)


REMAT = ("none", "selective", "full")
"""Remat policies the cost model knows, lightest first: keep everything; drop attention
scores; keep layer inputs (``Remat.policy``)."""


def candidate(
    *,
    zero: int = 0,
    microbatches: int = 1,
    schedule: str = "gpipe",
    virtual: int = 1,
    remat: str = "none",
    offload: bool = False,
    **sizes: int,
) -> ParallelPlan:
    """The ``ParallelPlan`` of one point of the search space.

    ``sizes`` are the mesh axis sizes by name (``data=8, tensor=2``; absent axes are 1).
    ``microbatches`` are the pipeline's with a stage axis (``pipeline.microbatches``) and
    gradient accumulation without one (``data.microbatches``): the cost model has one count.
    ``schedule`` and ``virtual`` are ``PipelineParallel``'s (gpipe, 1f1b,
    circular = interleaved); ``offload`` keeps the optimizer state on the host.
    """
    unknown = set(sizes) - {str(a) for a in AXIS_ORDER}
    if unknown:
        known = ", ".join(AXIS_ORDER)
        raise TypeError(f"candidate: no searched axis {sorted(unknown)}; axes: {known}.")
    axes = tuple((str(a), sizes[a]) for a in AXIS_ORDER if sizes.get(a, 1) > 1)
    staged = sizes.get(str(Axis.STAGE), 1) > 1
    return ParallelPlan(
        mesh=_mesh(axes or ((str(Axis.DATA), 1),)),
        data=_data(zero, 1 if staged else microbatches),
        pipeline=_pipeline(schedule, microbatches if staged else 0, virtual),
        remat=_remat(remat),
        offload=_offload(offload),
    )


# sections are frozen: the search's thousands of candidates share them
_mesh = functools.lru_cache(maxsize=4096)(MeshSpec)
_data = functools.lru_cache(maxsize=256)(DataParallel)
_pipeline = functools.lru_cache(maxsize=256)(PipelineParallel)
_remat = functools.lru_cache(maxsize=16)(Remat)
_offload = functools.lru_cache(maxsize=4)(lambda optimizer: Offload(optimizer=optimizer))


class PlanView:
    """What the cost terms read from a ``ParallelPlan``, derived once when the view is made
    (the search reads these numbers millions of times); the plan is the only input."""

    __slots__ = (
        "plan",
        "sizes",
        "data",
        "fsdp",
        "tensor",
        "context",
        "expert",
        "stage",
        "batch_ways",
        "zero",
        "microbatches",
        "accumulation",
        "schedule",
        "virtual",
        "remat",
        "offload",
        "fused_attention",
    )

    def __init__(self, plan: ParallelPlan):
        self.plan = plan
        self.sizes: dict[str, int] = dict(plan.mesh.axes)
        """Mesh axis sizes (absent axes: 1 below)."""
        get = self.sizes.get
        self.data, self.fsdp, self.tensor = get("data", 1), get("fsdp", 1), get("tensor", 1)
        self.context, self.expert, self.stage = get("context", 1), get("expert", 1), get("stage", 1)
        staged = self.stage > 1
        self.batch_ways: int = batch_ways(self.sizes)
        """Ways the batch is split (``BATCH_AXES``: data, FSDP and expert replicas)."""
        self.zero: int = plan.data.zero
        self.accumulation: int = plan.data.microbatches
        """Gradient-accumulation micro-batches (``data.microbatches``), stages or not."""
        self.microbatches: int = (
            (plan.pipeline.microbatches or self.stage) if staged else self.accumulation
        )
        """The cost model's one count: the pipeline's micro-batches with stages (0 in the
        plan: one per stage), else gradient accumulation's."""
        self.schedule: str = plan.pipeline.schedule if staged else "none"
        """``PipelineParallel.schedule`` (gpipe | 1f1b | circular); ``none`` without stages."""
        self.virtual: int = plan.pipeline.virtual_stages if staged else 1
        """Virtual stages per device (the circular schedule's v)."""
        self.remat: str = plan.remat.policy
        self.offload: bool = plan.offload.optimizer
        """Optimizer state in host memory between steps."""
        self.fused_attention: bool = plan.context.attention_impl == "cudnn"
        """One fused kernel (cuDNN's flash attention): the score matrix never reaches HBM,
        is never saved for the backward pass, and its products run at the kernel's rate."""

    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        return self.plan.mesh.axes

    @property
    def size(self) -> int:
        return math.prod(self.sizes.values())

    def mesh_text(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in self.axes)

    def knobs_text(self) -> str:
        """``zero1 circularx2 m=4 remat=full offload`` (``-`` when every knob is off)."""
        zero = f"zero{self.zero}" if self.zero else ""
        pipe = ""
        if self.stage > 1:
            pipe = self.schedule + (f"x{self.virtual}" if self.virtual > 1 else "")
        parts = [zero, pipe, f"m={self.microbatches}" if self.microbatches > 1 else ""]
        parts += [f"remat={self.remat}" if self.remat != "none" else ""]
        parts += ["offload" if self.offload else ""]
        return " ".join(p for p in parts if p) or "-"
