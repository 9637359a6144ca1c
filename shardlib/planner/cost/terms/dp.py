"""Data parallelism: every replica computes gradients of its rows; they are summed.

One reduction of the gradients per micro-batch (shardlib's accumulation loop reduces inside
the loop, as the compiled program shows; a pipeline's ``data`` replicas reduce once per
step, after its loop: ``pipeline.gradient_reductions``) over every axis whose devices hold
replicas of a parameter. Which axes those are, and how each reduces a parameter, is each
term's own ``reductions`` hook: the ``data`` axis here; any other axis whose devices hold
the same weights and see other rows or tokens says so in its own term. This term adds up
what they say, one collective per set of axes that reduce together.

With ZeRO-1/2 the all-reduce becomes a reduce-scatter of the gradients plus an all-gather of
the updated parameters over the axes that hold whole replicas (``Term.replicates``): the
same wire bytes (REFERENCE.md: 2Ψ for stages 0-2). Two things the compiled programs add
(jax 0.10.2, checked by ``planner.validate``):
- the CPU backend compiles each reduce-scatter as an all-reduce + slice (``backend="cpu"``);
- ZeRO-1 with micro-batches: the replicated accumulator is filled by a reduce-scatter and
  an all-gather of each micro-batch's gradients (XLA moves the optimizer's sharded layout
  into the loop), so the gradients cross the wire once more per micro-batch.
"""

from __future__ import annotations

import math
from collections import defaultdict

from shardlib.core.mesh import Axis
from shardlib.core.param_info import ParamInfo
from shardlib.planner.cost.terms.base import MASTER_BYTES, Comm, Contribution, Step
from shardlib.planner.cost.terms.declare import Knob, SearchAxis, Term, admits_any
from shardlib.planner.cost.terms.pipeline_loop import gradient_reductions

DATA = str(Axis.DATA)

SEARCH_AXIS = SearchAxis(
    Axis.DATA,
    placement=0,  # outermost: one gradient reduction per step, which tolerates a slow link
    admits=admits_any,
    splits=("batch",),
    rule="any size that splits the batch",
)


def gradient_reduction(step: Step) -> Contribution:
    view = step.view
    terms = [t for t in step.terms if t.reductions and view[str(t.axis.axis)] > 1]
    if not terms:
        return Contribution()
    m = view.accumulation
    kind = step.scatter_kind if view.zero else "all-reduce"

    # bytes per (axes of one all-reduce, inside the layer loop or not)
    buffers: dict[tuple[tuple[str, ...], bool], float] = defaultdict(float)
    for param, ways in step.table:
        shard = param.numel / ways * MASTER_BYTES * step.gradient_sets(param)
        merged: list[str] = []  # the axes that reduce the parameter's shard together
        for term in terms:
            for axes, nbytes in term.reductions(step, param):
                if nbytes is None:
                    merged += axes
                else:  # a reduction of its own, before the shared one
                    buffers[(axes, param.per_layer)] += nbytes
        if merged:
            reduced = tuple(merged)
            buffers[(reduced, param.per_layer)] += shard * step.read_share(param, reduced)

    def count(axes: tuple[str, ...], per_layer: bool) -> float:
        layer, outer = gradient_reductions(step, axes)
        return layer if per_layer else outer

    comms = [
        Comm(
            "dp",
            "grads",
            kind,
            axes,
            math.prod(view[a] for a in axes),
            size,
            count(axes, per_layer),
            True,
        )
        for (axes, per_layer), size in buffers.items()
    ]
    names = tuple(str(t.axis.axis) for t in terms if t.replicates)
    if view.zero and names:  # the updated parameters come back
        total = step.held_elements * MASTER_BYTES
        group = math.prod(view[a] for a in names)
        comms.append(Comm("dp", "params", "all-gather", names, group, total, 1, True))
        if view.zero == 1 and m > 1:  # the replicated accumulator, re-gathered per micro-batch
            comms.append(Comm("dp", "grads", "all-gather", names, group, total, m, True))
    return Contribution(comms=tuple(comms))


def _reductions(step: Step, param: ParamInfo) -> tuple:
    # 1-bit momentum: no gradient crosses data after the warm-up (``terms.onebit``)
    return () if step.view.onebit else (((DATA,), None),)


def _choices(workload, mesh, space) -> list[dict]:
    """ZeRO shards over ``data``. With any axis but tensor beside it XLA merges and places
    the reductions in ways the cost model does not follow (compiled: HSDP + ZeRO-2 memory
    1.08x; ZeRO-2 with 1F1B stages memory 0.82x, bytes 0.79x): those combinations are not
    searched (nor beside an axis added later, until measured)."""
    zeros = space.menu("zero")
    plain = all(s == 1 for a, s in mesh.items() if a not in (DATA, str(Axis.TENSOR)))
    if not (mesh[DATA] > 1 and plain):
        zeros = tuple(z for z in zeros if z == 0)
    return [{"zero": z} for z in zeros]


TERM = Term(
    "dp",
    cost=gradient_reduction,
    axis=SEARCH_AXIS,
    knobs=(Knob("zero", (0, 1, 2)),),
    settings=lambda view: {
        "zero": view.plan.data.zero,
        # gradient-accumulation micro-batches (``data.microbatches``), stages or not
        "accumulation": view.plan.data.microbatches,
    },
    unmodelled=lambda view: "ZeRO-3 over data (use an fsdp axis)" if view.zero > 2 else "",
    knobs_text=lambda view: f"zero{view.zero}" if view.zero else "",
    reductions=_reductions,
    replicates=True,
    # with stages the reduction runs after the pipeline's flush, exposed (as Megatron-LM's)
    exposed=lambda view: view[str(Axis.STAGE)] > 1,
    window="backward",  # a micro-batch's reduction hides behind its own backward pass
    choices=_choices,
)
