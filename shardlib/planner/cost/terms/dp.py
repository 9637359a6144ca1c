"""Data parallelism: every replica computes gradients of its rows; they are summed.

One reduction of the gradients per micro-batch (shardlib's accumulation loop reduces inside
the loop, as the compiled program shows; a pipeline's ``data`` replicas reduce once per
step, after its loop) over every axis that replicates a parameter: the
``data`` axis, and the context axis (its devices hold the same weights and see other
tokens). With ZeRO-1/2 the all-reduce becomes a reduce-scatter of the gradients plus an
all-gather of the updated parameters: the same wire bytes (REFERENCE.md: 2Ψ for stages 0-2).
Two things the compiled programs add (jax 0.10.2, checked by ``planner.validate``):
- the CPU backend compiles each reduce-scatter as an all-reduce + slice (``backend="cpu"``);
- ZeRO-1 with micro-batches: the replicated accumulator is filled by a reduce-scatter and
  an all-gather of each micro-batch's gradients (XLA moves the optimizer's sharded layout
  into the loop), so the gradients cross the wire once more per micro-batch.

Data and context together: what the compiled programs do (8 devices, llama-small) is
* without FSDP, two all-reduces of the whole gradient, one over ``context`` and one over
  ``data`` (the partitioner reduces the batch and the sequence contraction separately and
  XLA does not fold them): 2(c-1)/c·M + 2(d-1)/d·M, more than one reduction over both;
* with FSDP, one all-reduce over ``data,context`` of the FSDP shard, after the FSDP
  reduction (``terms.fsdp``), except one of the two vocab-sized matrices (the output
  projection, or the embedding when there is a data axis too): its context all-reduce runs
  on the whole matrix, before the FSDP slice. Either way that matrix costs the separate
  form, 2(c-1)/c·M_full + 2(d-1)/d·M_shard on top of the FSDP reduction. Not when FSDP
  runs the head vocab-parallel (``Context.vocab_tables``): its context all-reduce then
  runs on the FSDP shard, as every other matrix's.
"""

from __future__ import annotations

import math
from collections import defaultdict

from shardlib.core.mesh import Axis
from shardlib.planner.cost.terms.base import (
    MASTER_BYTES,
    Comm,
    Context,
    Contribution,
    SearchAxis,
    admits_any,
)
from shardlib.planner.cost.terms.pipeline import gradient_reductions

SEARCH_AXIS = SearchAxis(
    Axis.DATA,
    placement=0,  # outermost: one gradient reduction per step, which tolerates a slow link
    admits=admits_any,
    splits_batch=True,
    rule="any size that splits the batch",
)

_SEPARATE_WITH_FSDP = "lm_head"
"""The matrix whose context all-reduce runs unsliced under FSDP (equal in size to the
embedding, which XLA picks instead when there is a data axis: the same bytes)."""


def replica_axes(ctx: Context) -> tuple[tuple[str, int], ...]:
    """Axes that replicate every parameter: data and context."""
    p = ctx.p
    return tuple((str(a), s) for a, s in ((Axis.DATA, p.data), (Axis.CONTEXT, p.context)) if s > 1)


def gradient_reduction(ctx: Context) -> Contribution:
    p = ctx.p
    expert = str(Axis.EXPERT)
    if not replica_axes(ctx) and p.expert <= 1:
        return Contribution()
    m = p.microbatches if p.stage == 1 else 1
    layer_count, outer_count = gradient_reductions(ctx)  # with stages: the schedule's loop
    once = gradient_reductions(ctx, per_replica=True)  # data replicas: after the loop
    data, context = str(Axis.DATA), str(Axis.CONTEXT)
    sizes = {data: p.data, context: p.context, expert: p.expert}
    kind = ctx.scatter_kind if p.zero else "all-reduce"

    # bytes per (axes of one all-reduce, inside the layer loop or not)
    buffers: dict[tuple[tuple[str, ...], bool], float] = defaultdict(float)
    for param, ways, no_fsdp in ctx.table:
        shard = param.numel / ways * MASTER_BYTES
        # the expert axis folds into the batch: it replicates what it does not split
        merged = [a for a in (data, context) if sizes[a] > 1]
        if p.expert > 1 and expert not in ctx.splits[param.name]:
            merged.append(expert)
        separate = param.name == _SEPARATE_WITH_FSDP and param.name not in ctx.vocab_tables
        if p.context > 1 and (p.fsdp == 1 or separate):
            # the separate form: a context all-reduce of the whole matrix, then the rest
            buffers[((context,), param.per_layer)] += param.numel / no_fsdp * MASTER_BYTES
            merged.remove(context)
        if merged:
            buffers[(tuple(merged), param.per_layer)] += shard

    # an MoE's router statistics are not linear in the batch: its pipeline runs no data
    # replicas (``pipeline_layers``), so data-axis reductions stay in the loop too
    axes_once = (data,) if not ctx.w.experts else None

    def count(axes: tuple[str, ...], per_layer: bool) -> float:
        once_here = axes == axes_once and p.zero < 3
        layer, outer = once if once_here else (layer_count, outer_count)
        return layer if per_layer else outer

    comms = [
        Comm(
            "dp",
            "grads",
            kind,
            axes,
            math.prod(sizes[a] for a in axes),
            size,
            count(axes, per_layer),
            True,
        )
        for (axes, per_layer), size in buffers.items()
    ]
    names = tuple(a for a, _ in replica_axes(ctx))
    if p.zero and names:  # the updated parameters come back
        total = ctx.held_elements * MASTER_BYTES
        group = p.data * p.context
        comms.append(Comm("dp", "params", "all-gather", names, group, total, 1, True))
        if p.zero == 1 and m > 1:  # the replicated accumulator, re-gathered per micro-batch
            comms.append(Comm("dp", "grads", "all-gather", names, group, total, m, True))
    return Contribution(comms=tuple(comms))
