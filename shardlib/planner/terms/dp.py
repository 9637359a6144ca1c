"""Data parallelism: every replica computes gradients of its rows; they are summed.

One reduction of the gradients per micro-batch (shardlib's accumulation loop reduces inside
the loop, as the compiled program shows) over every axis that replicates a parameter: the
``data`` axis, and the context axis (its devices hold the same weights and see other
tokens). With ZeRO-1/2 the all-reduce becomes a reduce-scatter of the gradients plus an
all-gather of the updated parameters: the same wire bytes (REFERENCE.md: 2Ψ for stages 0-2).
Two things the compiled programs add (jax 0.10.2, checked by ``planner.validate``):
- the CPU backend compiles each reduce-scatter as an all-reduce + slice (``backend="cpu"``);
- ZeRO-1 with micro-batches: the replicated accumulator is filled by a reduce-scatter and
  an all-gather of each micro-batch's gradients (XLA moves the optimizer's sharded layout
  into the loop), so the gradients cross the wire once more per micro-batch.
"""

from __future__ import annotations

import math

from shardlib.mesh import Axis
from shardlib.planner.terms.base import MASTER_BYTES, Comm, Context, Contribution


def replica_axes(ctx: Context) -> tuple[tuple[str, int], ...]:
    p = ctx.p
    return tuple((str(a), s) for a, s in ((Axis.DATA, p.data), (Axis.CONTEXT, p.context)) if s > 1)


def gradient_reduction(ctx: Context) -> Contribution:
    axes = replica_axes(ctx)
    if not axes:
        return Contribution()
    p = ctx.p
    group = math.prod(s for _, s in axes)
    names = tuple(a for a, _ in axes)
    # gradients as sharded after any FSDP reduction (the parameters' own layout); a layer's
    # leave together inside the layer loop, the rest after it
    layer = sum(param.numel / ways for param, ways, _ in ctx.table if param.per_layer)
    outer = sum(param.numel / ways for param, ways, _ in ctx.table if not param.per_layer)
    m = p.microbatches if p.stage == 1 else 1
    parts = ((layer * MASTER_BYTES, ctx.layers_per_device * m), (outer * MASTER_BYTES, m))
    scatter = "all-reduce" if ctx.backend == "cpu" else "reduce-scatter"
    kind = scatter if p.zero else "all-reduce"
    comms = tuple(Comm("dp", "grads", kind, names, group, b, c, True) for b, c in parts)
    total = (layer * ctx.layers_per_device + outer) * MASTER_BYTES
    if p.zero:  # the updated parameters come back
        comms += (Comm("dp", "params", "all-gather", names, group, total, 1, True),)
    if p.zero == 1 and m > 1:  # the replicated accumulator, re-gathered per micro-batch
        comms += (Comm("dp", "grads", "all-gather", names, group, total, m, True),)
    return Contribution(comms=comms)
