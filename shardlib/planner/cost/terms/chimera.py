"""Chimera's own share (``parallel/pipeline/chimera.py``), on top of the fused 1F1B loop's.

Chimera runs the 1F1B loop's stage work (``terms.pipeline`` and ``pipeline_loop`` cost it
for both fused schedules: its ring of 2p - 1 saved layer inputs, m + p - 2 executed chunks
from ``PipelineSpec.executed``, so the bubble (p-2)/m, the embedding and head inside the
loop). What it adds, with W the fp32 bytes of one stage's blocks on a device:

* memory, what the loop keeps at its peak beside what 1F1B's keeps, in W: the up stages'
  weights (the flip of the stored rows over ``stage``, the paper's second weight copy: the
  down stage is the stored rows themselves) and the up chunk's fp32 gradient accumulator
  beside the down chunk's ([p, 2, k] for 1F1B's [p, k]), less the copy of its chunk 1F1B's
  layer scan makes every trip (W, in the state term's gradients beside the accumulator),
  which Chimera's does not: it reads its trip's chunk a layer at a time from the two
  stacks (``stage_work._layer_scan``). 1 + 1 - 1 = 1 W. Compiled minus 1F1B's compiled,
  both measured: 1.00 W on Megatron's 39B layout (tensor 8 x stage 2, m 16; the peak's
  buffers: the ring, 3 W of parameters and Adam, 2 W of accumulators, the 1 W flip),
  0.94-1.23 W on seven llama-tiny plans (``benchmarks/chimera.py``);
* memory, its loss head: none beside 1F1B's, both taking each stage's own targets
  (``terms.pipeline`` books the head for every fused loop: ``pipeline_loop.
  head_logits_bytes``). While 1F1B's head shared one micro-batch's targets over its
  stages it kept two fp32 logits-sized buffers more, and this term booked those two less;
* wire over ``stage``, per step: the weights' flip (one collective permute of W, the up
  stages' copies) and the gradients' flip back (W, fp32) that sums each stage's two
  replicas; per executed forward and backward a second hand-over permute (both rolls,
  +1 and -1, move every trip; the receiver picks its direction's), 1/t of b·s·h each.
"""

from __future__ import annotations

from shardlib.core.mesh import Axis
from shardlib.planner.cost.terms.base import MASTER_BYTES, Comm, Contribution, Step
from shardlib.planner.cost.terms.declare import Term
from shardlib.planner.cost.terms.pipeline_loop import executed, handover_split

UP_WEIGHTS, SECOND_ACCUMULATOR, CHUNK_COPY = 1, 1, 1  # in W, each one stage's blocks
CHIMERA_WEIGHT_SETS = UP_WEIGHTS + SECOND_ACCUMULATOR - CHUNK_COPY  # beside 1F1B's booking


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
    return Contribution(memory={"up stage weights": CHIMERA_WEIGHT_SETS * weights}, comms=comms)


TERM = Term("chimera", cost=chimera)
