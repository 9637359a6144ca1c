"""PipeDream-2BW's own share (``parallel/pipeline/two_bw.py``), on top of the fused 1F1B
loop's.

2bw runs 1F1B's loop (``terms.pipeline`` and ``pipeline_loop`` cost it: the ring of saved
layer inputs, v·m+p-1 executed chunks from ``PipelineSpec.executed``, so 1F1B's flush
bubble (p-1)/m: the loop that spans steps is not built) on the previous step's weights.
What it adds is the second weight version the train state keeps between steps, and
the copy the step makes of it, each every parameter the device holds, fp32, laid out as
the parameters (``STALE_WEIGHT_SETS``):

* W(t-1) in the state, beside W(t): the paper's 2W for the weights;
* a copy of W(t): the step writes W(t) to the output ``prev_params`` and W(t+1) to
  ``params``, and jit's donation pairs each output with the input in the same place, so
  W(t) is copied into the stale buffer while W(t+1) is computed (a toy step whose
  outputs exchange the two buffers instead has no such copy: +1 W, not +2 W).

No collective: both are local. Compiled minus 1F1B's compiled, four llama-tiny plans:
2.00-2.27 x the held parameters (``python benchmarks/two_bw.py memory``).
"""

from __future__ import annotations

from shardlib.planner.cost.terms.base import MASTER_BYTES, Contribution, Step, Term

STALE_WEIGHT_SETS = 2  # in held parameters: W(t-1) in the state, and the step's copy of W(t)


def two_bw(step: Step) -> Contribution:
    view = step.view
    if view["stage"] <= 1 or view.schedule != "2bw":
        return Contribution()
    return Contribution(
        memory={"stale weights (2bw)": STALE_WEIGHT_SETS * step.held_elements * MASTER_BYTES}
    )


TERM = Term("2bw", cost=two_bw)
