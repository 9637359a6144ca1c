"""What a plan costs per step: what a planner term returns, and what it reads about the step.

A term's cost is a ``Contribution``: the bytes it adds to each device's memory, the
collectives it runs (``Comm``), the FLOPs or seconds it adds. ``Step`` is what every term
reads: the workload, the plan, the plan's axis sizes and settings (``candidate.PlanView``),
and layout facts that belong to no one strategy (how each parameter is split:
``param_splits``, ``param_table``; the local batch and sequence). A fact of one strategy,
such as a pipeline's loop trips, is a function in that term's module (``per_step`` computes
it once per step). How a term declares itself to the search and to ``cost.total`` (``Term``,
``SearchAxis``, ``Knob``) is ``terms.declare``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from shardlib.analysis.report import ring_wire_bytes as ring_wire  # the one ring formula
from shardlib.core.errors import ShardingError
from shardlib.core.mesh import Axis
from shardlib.core.param_info import ParamInfo
from shardlib.core.resolve import resolve_spec
from shardlib.core.workload import Workload
from shardlib.parallel.mesh_rules import rules_for_mesh
from shardlib.parallel.pipeline.spec import FUSED_SCHEDULES
from shardlib.parallel.plan import ParallelPlan

if TYPE_CHECKING:  # candidate and declare import this module: types only here
    from shardlib.planner.candidate import PlanView
    from shardlib.planner.cost.terms.declare import Terms
    from shardlib.planner.inputs.cluster import Cluster

MASTER_BYTES = 4  # fp32 master weights and fp32 gradients (shardlib trains this way)
ADAM_BYTES = 8  # Adam m and v, fp32


@dataclass(frozen=True)
class Comm:
    """One collective of the step as a strategy predicts it."""

    strategy: str
    """Which term emitted it (``declare.Term.name``: ``fsdp``, ``tensor``, ...)."""
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
    window: str = ""
    """What compute it hides behind (``throughput.overlap_windows``), where it differs from
    its term's ``window`` ("": the term's)."""

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
    idle_flops: float = 0.0
    """Of ``flops``, those a schedule computes and discards (a pipeline's bubble): reported
    as bubble time, not compute."""
    seconds: float = 0.0
    """Time not covered by FLOPs or collectives (e.g. host transfers), per step."""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Step:
    """One training step of ``workload`` under ``plan``: everything a term may read."""

    workload: Workload
    plan: ParallelPlan
    backend: str
    """``gpu`` (reduce-scatter for sharded gradients, as the GPU/TPU pipelines do) or
    ``cpu`` (the CPU backend's all-reduce + slice: what compiled validation measures)."""
    view: PlanView = field(repr=False, compare=False)
    """The plan's axis sizes and settings (``candidate.PlanView(plan)``, made by the caller:
    ``candidate`` reads the terms' declarations, so the terms do not import it)."""
    terms: Terms = field(repr=False, compare=False)
    """The registered terms (``terms.TERMS``), whose hooks a term asks (``hooks``)."""
    calib: dict = field(default_factory=dict)
    """Fitted coefficients (``cost.coefficients.COEFFICIENTS``)."""
    cluster: Cluster | None = field(default=None, repr=False, compare=False)
    """The hardware, when time is predicted (None: memory and bytes only)."""
    memo: dict = field(default_factory=dict, repr=False, compare=False)
    """What terms derived once for this step (``per_step``)."""

    def hooks(self, name: str) -> tuple[Callable, ...]:
        """The terms' hooks called ``name`` (``declare.Term`` fields) that are set, in order."""
        return self.terms.hooks(name)

    @cached_property
    def splits(self) -> dict[str, dict[str, int]]:
        """Per parameter: mesh axis -> ways it splits that parameter."""
        return param_splits(self.workload, self.view.axes)

    def shard(self, param: ParamInfo, *, without: tuple[str, ...] = ()) -> int:
        """Ways ``param`` is split on one device, ignoring the axes in ``without``."""
        return _shard(self.splits[param.name], without)

    @cached_property
    def table(self) -> tuple[tuple[ParamInfo, int], ...]:
        """(param, ways split) per parameter."""
        return param_table(self.workload, self.view.axes)

    @cached_property
    def layer_elements(self) -> float:
        """One layer's parameter elements on one device (every axis's split)."""
        return sum(param.numel / ways for param, ways in self.table if param.per_layer)

    @cached_property
    def held_elements(self) -> float:
        """Parameter elements on one device: its layers, and the embedding, final norm and
        head (the trainer runs those outside the layer stack's split: every device holds
        them)."""
        outer = sum(param.numel / ways for param, ways in self.table if not param.per_layer)
        return self.layer_elements * self.layers_per_device + outer

    def gradient_sets(self, param: ParamInfo) -> int:
        """Gradients of ``param`` reduced apart before they are added: 2 for a tied table on
        the CPU backend (its lookup's and its head's, each reduced over data and fsdp on its
        own: gpt-tiny on data 8 reduces 2 table-sized sets, jax 0.10.2), else 1. XLA's GPU
        pipeline runs ``AllReduceReassociate``, which adds them first (TPU plans are costed
        as GPU's: its compiler is not public to check). A fused pipeline loop (1F1B, 2BW,
        Chimera) adds both into the one gradient its carry accumulates, reduced after the
        loop: one set (gpt3-1.3b width, 1F1B stage 2 x tensor 4: 141 MB compiled over
        ``stage``, 244 booked with two)."""
        tied = param.name == "embedding" and self.workload.tied_head
        fused = self.view.schedule in FUSED_SCHEDULES  # ``none`` without stages
        return 2 if tied and self.backend == "cpu" and not fused else 1

    def read_share(self, param: ParamInfo, axes: tuple[str, ...] = ()) -> float:
        """Share of ``param`` the step gathers, or reduces over ``axes``: a position table's
        first ``seq`` rows (``Workload.rows_read``), unless context parallelism reorders the
        positions (the zig-zag layout reads rows of the whole table) or the reduction spans
        ``stage`` (a fused pipeline loop accumulates the table's gradient whole)."""
        whole = self.view["context"] > 1 or str(Axis.STAGE) in axes
        return 1.0 if whole else self.workload.rows_read(param)

    @property
    def scatter_kind(self) -> str:
        """How a reduce-scatter compiles: the CPU backend emits an all-reduce + slice (2x the
        wire bytes; what compiled validation measures), the GPU/TPU pipelines a reduce-scatter."""
        return "all-reduce" if self.backend == "cpu" else "reduce-scatter"

    @cached_property
    def layers_per_device(self) -> int:
        """Blocks each device holds: all of them, or L/n where axes split the stacked
        ``layers`` dim n ways (``declare.SearchAxis.splits``); embedding and head stay on every
        device."""
        return math.ceil(self.workload.layers / self.view.ways("layers"))

    @property
    def micro_batch(self) -> int:
        """Sequences of one micro-batch on one device (TeraPipe: the whole per-device
        batch, whose sequences its loop cuts into ``microbatches`` token slices)."""
        view = self.view
        if view["stage"] > 1 and view.schedule == "terapipe":
            return self.workload.global_batch // view.ways("batch")
        return self.workload.global_batch // (view.microbatches * view.ways("batch"))

    @property
    def local_seq(self) -> int:
        """Tokens of one sequence on one device (the axes that split ``seq``; TeraPipe: of
        one token slice, which its loop carries)."""
        view = self.view
        if view["stage"] > 1 and view.schedule == "terapipe":
            return self.workload.seq // (view.ways("seq") * view.microbatches)
        return self.workload.seq // view.ways("seq")

    @property
    def tokens(self) -> float:
        """Tokens of the step on one device (every batch and sequence split)."""
        return self.workload.tokens / (self.view.ways("batch") * self.view.ways("seq"))


def per_step(fn: Callable[[Step], Any]) -> Callable[[Step], Any]:
    """A term's derived fact of a step, computed once per step (the search reads it many
    times per plan and costs thousands of plans)."""

    @functools.wraps(fn)
    def once(step: Step) -> Any:
        try:
            return step.memo[fn]
        except KeyError:
            value = step.memo[fn] = fn(step)
            return value

    return once


@functools.lru_cache(maxsize=4096)
def param_table(w: Workload, axes: tuple[tuple[str, int], ...]) -> tuple:
    splits = param_splits(w, axes)
    return tuple((param, _shard(splits[param.name], ())) for param in w.params)


def _shard(split: dict[str, int], without: tuple[str, ...]) -> int:
    return math.prod(n for a, n in split.items() if a not in without)


@functools.lru_cache(maxsize=4096)
def param_splits(w: Workload, axes: tuple[tuple[str, int], ...]) -> dict[str, dict[str, int]]:
    """How the real rules (``shardlib.parallel.plan.ParallelPlan.rules``) split each parameter.

    The mesh ``axes`` go through the rules of a plan on them, so the planner and the trainer
    agree by construction, whatever axes the terms declare (an axis that splits the stacked
    ``layers`` dim splits what ``ParamInfo`` leaves out: ``Step.layers_per_device`` counts
    it; an axis that splits the sequence splits activations only). Cached per mesh: the
    search's candidates on one mesh share it. Raises ShardingError when a dim does not
    divide.
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
