"""Data parallelism: every replica computes gradients of its rows; they are summed.

One reduction of the gradients per micro-batch (shardlib's accumulation loop reduces inside
the loop, as the compiled program shows) over every axis that replicates a parameter: the
``data`` axis, and the context axis (its devices hold the same weights and see other
tokens). With ZeRO-1/2 the all-reduce becomes a reduce-scatter of the gradients plus an
all-gather of the updated parameters: the same wire bytes (REFERENCE.md: 2Ψ for stages 0-2).

Data and context together: what the compiled programs do (8 devices, llama-small) is
* without FSDP, two all-reduces of the whole gradient, one over ``context`` and one over
  ``data`` (the partitioner reduces the batch and the sequence contraction separately and
  XLA does not fold them): 2(c-1)/c·M + 2(d-1)/d·M, more than one reduction over both;
* with FSDP, one all-reduce over ``data,context`` of the FSDP shard, after the FSDP
  reduction (``terms.fsdp``), except one of the two vocab-sized matrices (the output
  projection, or the embedding when there is a data axis too): its context all-reduce runs
  on the whole matrix, before the FSDP slice. Either way that matrix costs the separate
  form, 2(c-1)/c·M_full + 2(d-1)/d·M_shard on top of the FSDP reduction.
"""

from __future__ import annotations

from shardlib.mesh import Axis
from shardlib.planner.terms.base import MASTER_BYTES, Comm, Context, Contribution

_SEPARATE_WITH_FSDP = "lm_head"
"""The matrix whose context all-reduce runs unsliced under FSDP (equal in size to the
embedding, which XLA picks instead when there is a data axis: the same bytes)."""


def replica_axes(ctx: Context) -> tuple[tuple[str, int], ...]:
    p = ctx.p
    return tuple((str(a), s) for a, s in ((Axis.DATA, p.data), (Axis.CONTEXT, p.context)) if s > 1)


def gradient_reduction(ctx: Context) -> Contribution:
    axes = replica_axes(ctx)
    if not axes:
        return Contribution()
    p = ctx.p
    m = p.microbatches if p.stage == 1 else 1
    data, context = str(Axis.DATA), str(Axis.CONTEXT)

    # per part (layer or outer): (merged shard bytes, separate (full, shard) bytes)
    def parts(per_layer: bool) -> tuple[float, float, float]:
        merged = full = shard = 0.0
        for param, ways, no_fsdp in ctx.table:
            if param.per_layer != per_layer:
                continue
            separate = p.context > 1 and (p.fsdp == 1 or param.name == _SEPARATE_WITH_FSDP)
            if separate:
                full += param.numel / no_fsdp * MASTER_BYTES
                shard += param.numel / ways * MASTER_BYTES
            else:
                merged += param.numel / ways * MASTER_BYTES
        return merged, full, shard

    kind = "reduce-scatter" if p.zero else "all-reduce"
    names = tuple(a for a, _ in axes)
    group = p.data * p.context
    comms: list[Comm] = []
    for per_layer, count in ((True, ctx.layers_per_device * m), (False, m)):
        merged, full, shard = parts(per_layer)
        if merged:
            comms.append(Comm("dp", "grads", kind, names, group, merged, count, True))
        if full and p.context > 1:
            comms.append(Comm("dp", "grads", kind, (context,), p.context, full, count, True))
        if shard and p.data > 1:
            comms.append(Comm("dp", "grads", kind, (data,), p.data, shard, count, True))
    if p.zero:  # the updated parameters come back
        layer = sum(param.numel / ways for param, ways, _ in ctx.table if param.per_layer)
        outer = sum(param.numel / ways for param, ways, _ in ctx.table if not param.per_layer)
        total = (layer * ctx.layers_per_device + outer) * MASTER_BYTES
        comms.append(Comm("dp", "params", "all-gather", names, group, total, 1, True))
    return Contribution(comms=tuple(comms))
