"""Context parallelism (ring attention): the sequence split, K/V blocks passed round a ring.

Formula-only until sequence/context parallelism (issue 4) lands. Per layer and micro-batch,
the forward pass sends each K and V block to the next device c-1 times (Liu et al. 2023);
the backward pass sends K and V again plus their gradients: 3(c-1) permutes of a
2·b·(s/c)·g·d block per layer. They overlap with the block computations. Gradients are also
reduced over the context axis (``terms.dp``), and activations shrink by c (``terms.model``).
"""

from __future__ import annotations

from shardlib.mesh import Axis
from shardlib.planner.terms.base import Comm, Context, Contribution


def context(ctx: Context) -> Contribution:
    p, w = ctx.p, ctx.w
    if p.context <= 1:
        return Contribution()
    c, cfg = p.context, w.cfg
    block = 2 * ctx.micro_batch * ctx.local_seq * cfg.kv_heads / p.tensor * cfg.head_dim
    count = 3 * (c - 1) * ctx.layers_per_device * p.microbatches
    return Contribution(
        comms=(
            Comm(
                "context",
                "k/v blocks",
                "collective-permute",
                (str(Axis.CONTEXT),),
                c,
                block * w.compute_bytes,
                count,
                True,
            ),
        ),
        notes=("context: formula-only until issue 4 lands",),
    )
