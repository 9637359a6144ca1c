"""Optimizer-state offload: Adam's m and v live in host memory between steps.

Formula-only until offload (issue 3) lands. Device memory loses the optimizer state; every
step streams it to the device and back for the update (2 x its bytes over the host link,
not overlapped: ZeRO-Offload overlaps some of this, so this is pessimistic).
"""

from __future__ import annotations

from shardlib.planner.terms.base import Context, Contribution


def offload(ctx: Context, optimizer_bytes: float, host_link_bw: float) -> Contribution:
    if ctx.p.offload == "none":
        return Contribution()
    return Contribution(
        memory={"optimizer": -optimizer_bytes, "host: optimizer": optimizer_bytes},
        seconds=2 * optimizer_bytes / host_link_bw,
        notes=("offload: formula-only until issue 3 lands",),
    )
