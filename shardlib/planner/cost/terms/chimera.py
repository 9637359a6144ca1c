"""Chimera's own share (``parallel/pipeline/chimera.py``), on top of the fused 1F1B loop's.

Chimera runs the 1F1B loop's stage work (``terms.pipeline`` and ``pipeline_loop`` cost it
for both fused schedules: its ring of 2p - 1 saved layer inputs, m + p - 2 executed chunks
from ``PipelineSpec.executed``, so the bubble (p-2)/m, the embedding and head inside the
loop). What it adds, with W the fp32 bytes of one stage's blocks on a device:

* memory, 3 W: the doubled weights (the [p, 2, k] stack of each device's down stage and
  up stage, 2 W) and the up chunk's fp32 gradient accumulator beside the down chunk's (W),
  both live through the loop. The chunk a trip picks from the stack (a gather, where
  1F1B's v = 1 slices) adds W more on llama-tiny and nothing on llama-small, whose peak is
  elsewhere, so it is not booked. Compiled minus 1F1B's compiled: 4.0-4.2 W on five
  llama-tiny plans, 1.9 W on llama-small (``benchmarks/chimera.py``);
* wire over ``stage``, per step: the weights' flip (one collective permute of W, the up
  stages' copies) and the gradients' flip back (W, fp32) that sums each stage's two
  replicas; per executed forward and backward a second hand-over permute (both rolls,
  +1 and -1, move every trip; the receiver picks its direction's), 1/t of b·s·h each.
"""

from __future__ import annotations

from shardlib.core.mesh import Axis
from shardlib.planner.cost.terms.base import MASTER_BYTES, Comm, Contribution, Step, Term
from shardlib.planner.cost.terms.pipeline_loop import executed, handover_split

CHIMERA_WEIGHT_SETS = 3  # in W: the doubled stack 2, the second gradient accumulator 1


def stage_weight_bytes(step: Step) -> float:
    """W: one stage's blocks on one device, fp32 master weights (every axis's split)."""
    return step.layer_elements * step.layers_per_device * MASTER_BYTES


def chimera(step: Step) -> Contribution:
    view, w = step.view, step.workload
    if view["stage"] <= 1 or view.schedule != "chimera":
        return Contribution()
    axes, n = (str(Axis.STAGE),), view["stage"]
    weights = stage_weight_bytes(step)
    bsh = step.micro_batch * step.local_seq * w.embed * w.compute_bytes
    sends = 2 * executed(step)
    comms = (
        Comm("chimera", "doubled weights", "collective-permute", axes, n, weights, 1, True),
        Comm("chimera", "replica gradients", "collective-permute", axes, n, weights, 1, True),
        Comm(
            "chimera",
            "second hand-over",
            "collective-permute",
            axes,
            n,
            bsh / handover_split(step),
            sends,
            True,
        ),
    )
    return Contribution(
        memory={"doubled stage weights": CHIMERA_WEIGHT_SETS * weights}, comms=comms
    )


TERM = Term("chimera", cost=chimera)
