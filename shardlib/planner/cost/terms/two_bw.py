"""PipeDream-2BW's own share (``parallel/pipeline/two_bw_loop.py``), on top of the fused
loop's.

2bw runs 1F1B's stage work without a flush (``terms.pipeline`` and ``pipeline_loop`` cost
it as a fused schedule: the ring of 2p-1 saved layer inputs, the embedding and head inside
the loop, and m executed chunks from ``PipelineSpec.executed``, so no bubble). What it
adds, per device, in held fp32 parameters (``STATE_SETS + FIRST_TRIP_PICKS`` = 5):

* W(t-1) in the train state beside W(t) (``prev_params``): every parameter the device
  holds once more, fp32, the paper's 2W for the weights;
* the unfinished batch's gradient sums, carried in the state (``pipeline_carry``) and
  live beside the current batch's through the step: as many fp32 bytes again;
* the first 2p-2 trips' per-device picks (``two_bw_loop._pick``): each device chooses
  W(t-1) or W(t) for its forward and for its backward, and the previous or the current
  accumulators for its backward. The compiled step materializes each pick as a buffer of
  the stage's weights (``broadcast_select_fusion`` values at their own offsets of the
  temporary allocation, in the buffer assignment), so three more sets.

The carried ring of 2p-1 saved layer inputs and the two hand-overs are not booked here:
the loop runs in place on the donated carry (the buffer assignment puts every while
loop's ring value in the ring parameter's own allocation), so the ring the pipeline term
books moves from the step's temporaries into its arguments, the same bytes. Booking it
again read 1.189 of compiled memory on stage2 x fsdp2 x tensor2 (where the ring is 5.5
held-parameter units); the compiled 2bw - 1f1b differences on the four plans of
``python benchmarks/two_bw.py memory`` are 4.3-5.1 units against 5 booked.
"""

from __future__ import annotations

from shardlib.planner.cost.terms.base import MASTER_BYTES, Contribution, Step
from shardlib.planner.cost.terms.declare import Term

STATE_SETS = 2  # in held parameters: W(t-1), and the carried unfinished gradient sums
FIRST_TRIP_PICKS = 3  # forward weights, backward weights, backward accumulators


def two_bw(step: Step) -> Contribution:
    view = step.view
    if view["stage"] <= 1 or view.schedule != "2bw":
        return Contribution()
    unit = step.held_elements * MASTER_BYTES
    return Contribution(
        memory={
            "2bw stale weights and carried gradients": STATE_SETS * unit,
            "2bw first trips' weight and accumulator picks": FIRST_TRIP_PICKS * unit,
        }
    )


TERM = Term("2bw", cost=two_bw)
