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
* memory, what its loss head keeps below 1F1B's: two fp32 logits-sized buffers
  (``head_logits_bytes``). 1F1B's head takes one micro-batch's targets for all stages
  (``vmap`` with ``in_axes=None``), so the gradient of the target's log-probability (the
  transpose of ``take_along_axis``, a scatter of the one-hot) has no stage dim and is a
  buffer of its own, scheduled ahead of the head, added to the softmax's gradient once per
  matmul layout: 4 logits-sized buffers live at once in XLA's live ranges
  (``--xla_dump_to``: llama-tiny stage 4 x tensor 2 and llama-small stage 2 x data 2 x
  tensor 2). Chimera's head takes each device's own targets (``in_axes=0``): the scatter
  adds in place into the softmax's gradient, 2 live at once. It counts where the head's
  backward is the step's peak (a large vocabulary per device): llama-small at 8192 / 2,
  where Chimera compiles 1.06 W below 1F1B (read 1.141 of compiled without it, 0.995
  with). On llama-tiny (vocab 128-256 per device) a layer's backward is the peak, which
  the head's buffers are not part of: there the booked difference falls 0.2-2.0 W below
  the compiled one, the two buffers being 2-4.4% of the step (Chimera 0.935-1.034 of
  compiled on the seven plans, 1F1B 0.975-1.063);
* wire over ``stage``, per step: the weights' flip (one collective permute of W, the up
  stages' copies) and the gradients' flip back (W, fp32) that sums each stage's two
  replicas; per executed forward and backward a second hand-over permute (both rolls,
  +1 and -1, move every trip; the receiver picks its direction's), 1/t of b·s·h each.
"""

from __future__ import annotations

from shardlib.core.mesh import Axis
from shardlib.planner.cost.terms.base import MASTER_BYTES, Comm, Contribution, Step, Term
from shardlib.planner.cost.terms.model import head_rows, logits_share
from shardlib.planner.cost.terms.pipeline_loop import executed, handover_split

UP_WEIGHTS, SECOND_ACCUMULATOR, CHUNK_COPY = 1, 1, 1  # in W, each one stage's blocks
CHIMERA_WEIGHT_SETS = UP_WEIGHTS + SECOND_ACCUMULATOR - CHUNK_COPY  # beside 1F1B's booking
ONE_HOT, SECOND_LAYOUT = 1, 1  # fp32 logits-sized buffers of 1F1B's head backward
HEAD_LOGITS_SPARED = ONE_HOT + SECOND_LAYOUT  # that Chimera's does not keep


def stage_weight_bytes(step: Step) -> float:
    """W: one stage's blocks on one device, fp32 master weights (every axis's split)."""
    return step.layer_elements * step.layers_per_device * MASTER_BYTES


def head_logits_bytes(step: Step) -> float:
    """One fp32 logits-sized buffer of the loss head on one device: the rows it runs on
    (one micro-batch inside the loop), the tokens whose logits are live at once
    (``logits_share``), the vocabulary split over ``tensor``."""
    w, view = step.workload, step.view
    tokens = head_rows(step) * step.local_seq * logits_share(step)
    return tokens * w.vocab / view["tensor"] * 4


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
    memory = {
        "up stage weights": CHIMERA_WEIGHT_SETS * weights,
        "head logits (fewer than 1F1B's)": -HEAD_LOGITS_SPARED * head_logits_bytes(step),
    }
    return Contribution(memory=memory, comms=comms)


TERM = Term("chimera", cost=chimera)
