"""Data parallelism: every replica computes gradients of its rows; they are summed.

One reduction of the gradients per micro-batch (shardlib's accumulation loop reduces inside
the loop, as the compiled program shows) over every axis that replicates a parameter: the
``data`` axis, and the context axis (its devices hold the same weights and see other
tokens). With ZeRO-1/2 (formula-only until issue 3 lands) the all-reduce becomes a
reduce-scatter of the gradients plus an all-gather of the updated parameters: the same wire
bytes (REFERENCE.md: 2Ψ for stages 0-2).
"""

from __future__ import annotations

import math

from shardlib.mesh import Axis
from shardlib.planner.terms.base import MASTER_BYTES, Comm, Context, Contribution
from shardlib.planner.terms.pipeline import gradient_reductions


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
    layer_count, outer_count = gradient_reductions(ctx)  # with stages: the schedule's loop
    parts = ((layer * MASTER_BYTES, layer_count), (outer * MASTER_BYTES, outer_count))
    kind = "reduce-scatter" if p.zero else "all-reduce"
    comms = tuple(Comm("dp", "grads", kind, names, group, b, c, True) for b, c in parts)
    if p.zero:  # the updated parameters come back
        total = (layer * ctx.layers_per_device + outer) * MASTER_BYTES
        comms += (Comm("dp", "params", "all-gather", names, group, total, 1, True),)
    return Contribution(comms=comms)
