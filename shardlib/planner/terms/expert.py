"""Expert parallelism: tokens go to the devices holding their experts and come back.

Formula-only until expert parallelism (issue 5) lands. Each MoE layer runs one all-to-all
to dispatch and one to combine in forward, two more in backward, each of about k·b·s·h
elements per device (GShard; REFERENCE.md), times a capacity factor of 1.25 for the padded
expert buffers. They are on the critical path. Expert weights are split over the axis by
the layout (``terms.base.param_splits``), so they cost no gathers.
"""

from __future__ import annotations

from shardlib.mesh import Axis
from shardlib.planner.terms.base import Comm, Context, Contribution

CAPACITY_FACTOR = 1.25


def expert(ctx: Context) -> Contribution:
    p, w = ctx.p, ctx.w
    if p.expert <= 1 or not w.experts:
        return Contribution()
    tokens = ctx.micro_batch * ctx.local_seq
    buffer = CAPACITY_FACTOR * w.top_k * tokens * w.embed * w.compute_bytes
    count = 4 * ctx.layers_per_device * p.microbatches
    return Contribution(
        comms=(
            Comm(
                "expert",
                "tokens",
                "all-to-all",
                (str(Axis.EXPERT),),
                p.expert,
                buffer,
                count,
                False,
            ),
        ),
        notes=("expert: formula-only until issue 5 lands",),
    )
