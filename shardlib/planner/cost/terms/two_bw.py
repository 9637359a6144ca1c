"""PipeDream-2BW's own share (``parallel/pipeline/two_bw_loop.py``), on top of the fused
loop's.

2bw runs 1F1B's stage work without a flush (``terms.pipeline`` and ``pipeline_loop`` cost
it as a fused schedule: the ring of 2p-1 saved layer inputs, the embedding and head inside
the loop, and m executed chunks from ``PipelineSpec.executed``, so no bubble). What it
adds, per device:

* W(t-1) in the train state beside W(t) (``prev_params``): every parameter the device
  holds once more, fp32, the paper's 2W for the weights;
* the unfinished batch's gradient sums, carried in the state (``pipeline_carry``) and
  live beside the current batch's through the step: as many fp32 bytes again;
* the carried pipeline work: the ring of 2p-1 saved layer inputs and the two hand-over
  buffers (b·s·h each, whole over ``tensor``), which now live in the state between steps.
  The pipeline term books the ring once, as the step's own buffer; compiled, the step's
  temporaries do not shrink by it (measured: 1F1B's and 2bw's temp bytes are equal
  within 2%), so it is booked again here.

Compiled minus 1F1B's compiled and planner against compiled: ``python
benchmarks/two_bw.py memory`` (README, "No flush between steps").
"""

from __future__ import annotations

from shardlib.planner.cost.terms.base import MASTER_BYTES, Contribution, Step, Term
from shardlib.planner.cost.terms.pipeline_loop import stage_inputs_saved

STALE_WEIGHT_SETS = 2  # in held parameters: W(t-1), and the carried unfinished gradient sums


def two_bw(step: Step) -> Contribution:
    view, w = step.view, step.workload
    if view["stage"] <= 1 or view.schedule != "2bw":
        return Contribution()
    bsh = step.micro_batch * step.local_seq * w.embed * w.compute_bytes
    carried = (stage_inputs_saved(step) + 2) * bsh
    return Contribution(
        memory={
            "2bw stale weights and carried gradients": (
                STALE_WEIGHT_SETS * step.held_elements * MASTER_BYTES
            ),
            "2bw carried pipeline work": carried,
        }
    )


TERM = Term("2bw", cost=two_bw)
