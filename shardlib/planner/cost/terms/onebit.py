"""1-bit Adam / 1-bit LAMB (``parallel.data.onebit_momentum``; ``train/onebit.py``): the
momentum crosses ``data`` as packed signs with per-chunk fp32 scales.

After the warm-up (``optimizer.freeze_step`` steps of the fp32 all-reduce) no gradient is
all-reduced: each step runs DeepSpeed's compressed all-reduce (Tang et al. 2021, Alg. 1;
``NcclBackend.compressed_allreduce``; 1-bit LAMB, Li et al. 2021, sends the same) on the
flat momentum of P elements (Ψ padded to whole bytes of signs in each of N chunks):

- a compressed all-to-all: worker chunk j (P/N signs, P/(8N) bytes) to server j, and one
  fp32 scale per chunk (N·4 bytes);
- a compressed all-gather: each server's averaged chunk (P/(8N) bytes) and its scale.

So 2(N-1)/N · (P/8 + 4N) bytes per device, against the fp32 all-reduce's 2(N-1)/N · 4Ψ:
1/32. This term books that steady state: ``dp`` books no gradient reduction for such a
plan (``dp._reductions``), so the warm-up's fp32 all-reduce, a fixed number of steps at
the start of training, is not in the per-step estimate. Memory: the two error-feedback
buffers, the worker's [P] and its server chunk's [P/N] in fp32 (``train/onebit.py``
stores them split over ``data``); the moments are Adam's (``terms.state``).
``tests/planner/test_planner_onebit.py`` checks the bytes against the compiled step.
"""

from __future__ import annotations

from shardlib.core.mesh import Axis
from shardlib.planner.cost.terms.base import Comm, Contribution, Step
from shardlib.planner.cost.terms.declare import Term

DATA = str(Axis.DATA)
SCALE_BYTES = 4
"""One fp32 scale per chunk (DeepSpeed's ``worker_scale`` / ``server_scale``)."""


def padded_elements(numel: float, n: int) -> float:
    """Ψ rounded up to whole bytes of signs in each of n chunks (``onebit.padded_size``)."""
    return -(-int(numel) // (8 * n)) * 8 * n


def onebit(step: Step) -> Contribution:
    view = step.view
    n = view[DATA]
    if not view.onebit or n == 1:
        return Contribution()
    p = padded_elements(step.workload.param_count, n)
    axes, signs, scales = (DATA,), p / 8, n * SCALE_BYTES
    comms = (
        Comm("onebit", "momentum signs", "all-to-all", axes, n, signs, 1, False),
        Comm("onebit", "momentum scales", "all-to-all", axes, n, scales, 1, False),
        Comm("onebit", "averaged signs", "all-gather", axes, n, signs, 1, False),
        Comm("onebit", "averaged scales", "all-gather", axes, n, scales, 1, False),
    )
    errors = (p + p / n) * 4  # worker error [P] and server error [P/N], fp32, per device
    return Contribution(memory={"optimizer": errors}, comms=comms)


TERM = Term(
    "onebit",
    cost=onebit,
    settings=lambda view: {"onebit": view.plan.data.onebit_momentum},
    knobs_text=lambda view: "1-bit momentum" if view.onebit else "",
)
