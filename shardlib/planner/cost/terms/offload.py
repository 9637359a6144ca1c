"""Optimizer-state offload: Adam's m and v live in host memory between steps.

The trainer's ``offload_optimizer`` keeps the optimizer state in pinned host memory: device
memory loses it (compiled: the device total falls by exactly its bytes, and the arguments
whose sharding says ``pinned_host`` are these bytes), and every step streams it to the
device and back for the update (2 x its bytes over the host link, not overlapped:
ZeRO-Offload overlaps some of this, so this is pessimistic).
"""

from __future__ import annotations

from shardlib.planner.cost.terms.base import Context, Contribution


def offload(ctx: Context, optimizer_bytes: float, host_link_bw: float) -> Contribution:
    if not ctx.p.offload:
        return Contribution()
    return Contribution(
        memory={"optimizer": -optimizer_bytes, "host: optimizer": optimizer_bytes},
        seconds=2 * optimizer_bytes / host_link_bw,
    )
