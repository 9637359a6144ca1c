"""Optimizer-state offload: Adam's m and v live in host memory between steps.

The trainer's ``offload_optimizer`` keeps the optimizer state in pinned host memory: device
memory loses it (compiled: the device total falls by exactly its bytes, and the arguments
whose sharding says ``pinned_host`` are these bytes), and every step streams it to the
device and back for the update (2 x its bytes over the host link, not overlapped:
ZeRO-Offload overlaps some of this, so this is pessimistic).
"""

from __future__ import annotations

from shardlib.planner.cost.terms.base import Contribution, Knob, Step, Term
from shardlib.planner.cost.terms.state import optimizer_bytes

HOST_LINK_BW = 25e9
"""Host link bytes per second when no cluster is given (memory-only estimates)."""


def offload(step: Step) -> Contribution:
    if not step.view.offload:
        return Contribution()
    moved = optimizer_bytes(step)
    host_link_bw = step.cluster.host_link_bw if step.cluster else HOST_LINK_BW
    return Contribution(
        memory={"optimizer": -moved, "host: optimizer": moved},
        seconds=2 * moved / host_link_bw,
    )


TERM = Term(
    "offload",
    cost=offload,
    knobs=(Knob("offload", (False, True), trades=True),),
    settings=lambda view: {"offload": view.plan.offload.optimizer},
    unmodelled=lambda view: "offload.params" if view.plan.offload.params else "",
    knobs_text=lambda view: "offload" if view.offload else "",
)
