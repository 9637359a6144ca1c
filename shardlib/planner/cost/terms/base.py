"""What every strategy term returns, and the layout of each parameter under a plan.

A term is one small function per strategy, ``term(ctx) -> Contribution``: the bytes it adds
to each device's memory, the collectives it runs (kind, mesh axes, the unsharded buffer M
of REFERENCE.md, executions per step), and the FLOPs or seconds it adds. ``cost.estimate``
sums them; nothing else knows a strategy's formula.

A term that owns a mesh axis also declares it for the search (``SearchAxis``): where the
axis sits in the mesh, which sizes it admits, whether the batch splits over it. The
declarations are collected in ``planner.terms.SEARCH_AXES``; the search and ``candidate``
read nothing else about axes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from shardlib.analysis.report import ring_wire_bytes as ring_wire  # the one ring formula
from shardlib.core.errors import ShardingError
from shardlib.core.mesh import Axis
from shardlib.core.rules import resolve_spec
from shardlib.core.workload import ParamInfo, Workload
from shardlib.parallel.fsdp import vocab_parallel_pays
from shardlib.parallel.pipeline.gpipe import PipelineSpec
from shardlib.parallel.plan import ParallelPlan, rules_for_mesh

if TYPE_CHECKING:  # candidate and search read the declarations below: types only here
    from shardlib.planner.candidate import PlanView
    from shardlib.planner.inputs.cluster import Cluster
    from shardlib.planner.search import Space

MASTER_BYTES = 4  # fp32 master weights and fp32 gradients (shardlib trains this way)
ADAM_BYTES = 8  # Adam m and v, fp32


Admits = Callable[["Workload", "Cluster", "Space", Mapping[str, int], int], bool]
"""``admits(workload, cluster, space, chosen, size)``: may the axis take ``size`` (> 1),
given the sizes ``chosen`` for the axes before it in ``SEARCH_AXES``?"""


def admits_any(workload, cluster, space, chosen, size) -> bool:
    """No constraint of its own (the batch split is checked for every batch axis at once)."""
    return True


@dataclass(frozen=True)
class SearchAxis:
    """A mesh axis a strategy owns, as the search sizes it (one per term that owns an axis)."""

    axis: Axis
    """The mesh axis."""
    placement: int
    """Where it sits in the mesh, outermost smallest. The last axes vary fastest over device
    ids and so stay inside a host (the fastest link): the axis whose collectives sit on the
    critical path of every layer goes innermost, once-per-step traffic outermost."""
    admits: Admits
    """Which sizes > 1 the axis may take (1, the axis absent, always may): the checks the
    search makes before costing, so that a size the trainer refuses is never enumerated."""
    splits_batch: bool
    """Whether each index along the axis gets its own rows of the batch (data, FSDP and
    expert replicas): the global batch must divide by the product of these sizes."""
    rule: str = ""
    """The admission constraint in words, for the error when a fixed size is refused."""
    check: Callable[[Workload, PlanView], None] | None = None
    """``check(workload, view)``: the shape constraints of a given plan with this axis > 1,
    raising ShardingError (``cost.check`` runs it before costing)."""


@dataclass(frozen=True)
class Comm:
    """One collective of the step as a strategy predicts it."""

    strategy: str
    """Which term emitted it (``fsdp``, ``tensor``, ...)."""
    what: str
    """What is moved, for the explanation (``weights``, ``grads``, ``activations``)."""
    kind: str
    """all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute."""
    axes: tuple[str, ...]
    """Mesh axes its groups span."""
    group: int
    """Devices per group."""
    buffer_bytes: float
    """The full (unsharded) M per execution."""
    count: float
    """Executions per step."""
    overlap: bool
    """Whether it can hide behind compute (weight prefetch, gradient reduction)."""
    ops: int = 1
    """Collectives per execution when several tensors are listed as one (latency counts)."""

    @property
    def wire_bytes(self) -> float:
        """Per device, per step."""
        return ring_wire(self.kind, self.buffer_bytes, self.group) * self.count


@dataclass(frozen=True)
class Contribution:
    """A term's share of the step."""

    memory: dict[str, float] = field(default_factory=dict)
    """Bytes per device by part (``params``, ``grads``, ``activations``, ...)."""
    comms: tuple[Comm, ...] = ()
    flops: float = 0.0
    """FLOPs per device per step."""
    seconds: float = 0.0
    """Time not covered by FLOPs or collectives (e.g. host transfers), per step."""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Context:
    """Everything a term may read: the workload, the plan, and derived layout facts."""

    workload: Workload
    plan: ParallelPlan
    backend: str
    """``gpu`` (reduce-scatter for sharded gradients, as the GPU/TPU pipelines do) or
    ``cpu`` (the CPU backend's all-reduce + slice: what compiled validation measures)."""
    p: PlanView = field(repr=False, compare=False)
    """The plan's axis sizes and knobs (``candidate.PlanView(plan)``, made by the caller:
    ``candidate`` reads the axes the terms declare, so the terms do not import it)."""
    calib: dict = field(default_factory=dict)
    """Fitted coefficients (``planner.calibration.COEFFICIENTS``)."""

    @property
    def w(self) -> Workload:
        return self.workload

    @cached_property
    def splits(self) -> dict[str, dict[str, int]]:
        """Per parameter: mesh axis -> ways it splits that parameter."""
        return param_splits(self.w, self.p.axes)

    def shard(self, param: ParamInfo, *, without: tuple[str, ...] = ()) -> int:
        """Ways ``param`` is split on one device, ignoring the axes in ``without``."""
        return _shard(self.splits[param.name], without)

    @cached_property
    def table(self) -> tuple[tuple[ParamInfo, int, int], ...]:
        """(param, ways split, ways split by axes other than fsdp) per parameter."""
        return param_table(self.w, self.p.axes)

    @cached_property
    def vocab_tables(self) -> tuple[str, ...]:
        """The vocab-sized tables FSDP splits on vocab, its lookup and logits vocab-parallel
        (``ParallelPlan.for_target``, ``strategies.fsdp.vocab_parallel_pays``): ``terms.fsdp``
        costs their activation collectives instead of table gathers, and ``terms.tensor`` /
        ``terms.dp`` leave out what those replace. Never under a pipeline (the trainer's
        choice: the head runs outside the stage loop)."""
        p, w = self.p, self.w
        tokens = w.global_batch * w.seq // max(p.batch_ways // p.fsdp, 1)
        if p.fsdp <= 1 or p.stage > 1:
            return ()
        if not vocab_parallel_pays(tokens, w.vocab, p.fsdp, p.tensor):
            return ()
        return ("embedding", "lm_head")

    @cached_property
    def layer_elements(self) -> float:
        """One layer's parameter elements on one device (every axis's split)."""
        return sum(param.numel / ways for param, ways, _ in self.table if param.per_layer)

    @cached_property
    def layer_elements_gathered(self) -> float:
        """... as FSDP gathers them (every split but the fsdp axis's)."""
        return sum(param.numel / ways for param, _, ways in self.table if param.per_layer)

    @cached_property
    def held_elements(self) -> float:
        """Parameter elements on one device: its layers, and the embedding, final norm and
        head (the trainer runs those outside the pipeline: every stage holds them)."""
        outer = sum(param.numel / ways for param, ways, _ in self.table if not param.per_layer)
        return self.layer_elements * self.layers_per_device + outer

    @property
    def scatter_kind(self) -> str:
        """How a reduce-scatter compiles: the CPU backend emits an all-reduce + slice (2x the
        wire bytes; what compiled validation measures), the GPU/TPU pipelines a reduce-scatter."""
        return "all-reduce" if self.backend == "cpu" else "reduce-scatter"

    @cached_property
    def trips(self) -> int:
        """Pipeline loop iterations (``iterations``); 1 without stages."""
        p = self.p
        return iterations(p.schedule, p.stage, p.microbatches, p.virtual)

    @cached_property
    def executed(self) -> int:
        """Chunk forwards (and backwards) a stage executes per step: the trips, except for
        1f1b, whose warm-up trips run only forwards and cool-down only backwards
        (``PipelineSpec.executed``: v·m+p-1); 1 without stages."""
        p = self.p
        if p.stage == 1:
            return 1
        v = p.virtual if p.schedule in VIRTUAL_SCHEDULES else 1
        return PipelineSpec(p.stage, p.microbatches, v, p.schedule).executed()

    def param_copies(self, param: ParamInfo) -> int:
        """How many copies of a per-layer parameter one device's program holds (its layers)."""
        return self.layers_per_device if param.per_layer else 1

    @cached_property
    def layers_per_device(self) -> int:
        """Blocks each device holds: all of them, or L/p with p pipeline stages.

        The trainer splits the stacked ``layers`` dim evenly over ``stage`` (interleaved: v
        groups of L/(p·v)); embedding and head stay outside the pipeline on every stage.
        """
        w, p = self.w, self.p
        return w.layers if p.stage == 1 else math.ceil(w.layers / p.stage)

    @cached_property
    def layer_runs(self) -> float:
        """Block executions on one micro-batch per device and step (forward, say).

        L·m without stages; with them the pipeline loop's executed chunks times the
        L/(p·v) blocks of one (``executed``): the bubble's trips compute too.
        """
        p = self.p
        if p.stage == 1:
            return self.layers_per_device * p.microbatches
        v = p.virtual if p.schedule in VIRTUAL_SCHEDULES else 1
        return self.layers_per_device / v * self.executed

    @property
    def micro_batch(self) -> int:
        """Sequences of one micro-batch on one device."""
        return self.w.global_batch // (self.p.microbatches * self.p.batch_ways)

    @property
    def local_seq(self) -> int:
        return self.w.seq // self.p.context


@functools.lru_cache(maxsize=4096)
def param_table(w: Workload, axes: tuple[tuple[str, int], ...]) -> tuple:
    splits = param_splits(w, axes)
    return tuple(
        (param, _shard(splits[param.name], ()), _shard(splits[param.name], (str(Axis.FSDP),)))
        for param in w.params
    )


def _shard(split: dict[str, int], without: tuple[str, ...]) -> int:
    return math.prod(n for a, n in split.items() if a not in without)


@functools.lru_cache(maxsize=4096)
def param_splits(w: Workload, axes: tuple[tuple[str, int], ...]) -> dict[str, dict[str, int]]:
    """How the real rules (``shardlib.parallel.plan.ParallelPlan.rules``) split each parameter.

    The mesh ``axes`` go through the rules of a plan on them, so the planner and the trainer
    agree by construction, whatever axes the terms declare (the stage axis splits the
    stacked ``layers`` dim, which ``ParamInfo`` leaves out: ``Context.layers_per_device``
    counts it; context splits activations only). Cached per mesh: the search's candidates
    on one mesh share it. Raises ShardingError when a dim does not divide.
    """
    sizes = {str(a): s for a, s in axes if s > 1}
    rules = rules_for_mesh(sizes or {"data": 1})
    where = " x ".join(f"{a}={s}" for a, s in sizes.items()) or "data=1"
    out: dict[str, dict[str, int]] = {}
    for param in w.params:
        names = tuple(name for name, _ in param.dims)
        shape = tuple(size for _, size in param.dims)
        try:  # the trainer's own resolution: FSDP's one dim per tensor included
            spec = resolve_spec(param.name, shape, names, rules, sizes or {"data": 1})
        except ShardingError as error:
            raise ShardingError(f"plan {where}: {error}") from None
        split: dict[str, int] = {}
        for entry in spec:
            entry = (entry,) if isinstance(entry, str) else entry or ()
            split.update((a, sizes[a]) for a in entry)
        out[param.name] = split
    return out


VIRTUAL_SCHEDULES = ("circular", "1f1b")  # schedules with v virtual stages per device


def iterations(schedule: str, stages: int, microbatches: int, virtual: int) -> int:
    """Loop trips: the trainer's own count (``PipelineSpec.iterations``: m+p-1 GPipe,
    v·m+p-1 circular, v·m+v·p+p-2 (interleaved) 1F1B); 1 without stages."""
    if stages == 1:
        return 1
    v = virtual if schedule in VIRTUAL_SCHEDULES else 1
    return PipelineSpec(stages, microbatches, v, schedule).iterations()
