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
    # gradients as sharded after any FSDP reduction: the parameters' own layout
    buffer = 0.0
    for param in ctx.w.params:
        buffer += param.numel * ctx.param_copies(param) / ctx.shard(param) * MASTER_BYTES
    count = p.microbatches if p.stage == 1 else 1
    if p.zero:
        comms = (
            Comm("dp", "grads", "reduce-scatter", names, group, buffer, count, True),
            Comm("dp", "params", "all-gather", names, group, buffer, 1, True),
        )
    else:
        comms = (Comm("dp", "grads", "all-reduce", names, group, buffer, count, True),)
    return Contribution(comms=comms)
