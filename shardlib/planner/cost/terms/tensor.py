"""Megatron tensor parallelism: per-layer all-reduces of the residual stream.

Forward: one all-reduce of b·s·h after the attention output projection and one after the
MLP down projection (Shoeybi et al. 2019). Backward: one per block for the input gradient
of the column-parallel projections; models/llama/model.py computes Q/K/V and gate/up as single
products so that these gradients are summed locally before the one all-reduce, as in
Megatron: 4 all-reduces of b·s·h per layer in all. Outside
the loop: the vocab-parallel embedding lookup (one b·s·h all-reduce), the softmax's max,
sum and target pick over the split vocab (three of b·s fp32 values) and the head's input
gradient (b·s·h). Under full remat the saved layer input is kept split over tensor and
all-gathered once per layer before its recompute (``terms.remat.saved_input_split``). These
sit on the critical path: nothing overlaps them. Under FSDP's
vocab-parallel head (``fsdp.vocab_tables``) the vocab splits over fsdp x tensor and
those run over both axes (``terms.fsdp``).
"""

from __future__ import annotations

import math

from shardlib.core.mesh import Axis
from shardlib.parallel.pipeline.spec import FUSED_SCHEDULES
from shardlib.planner.cost.terms.base import Comm, Contribution, Step
from shardlib.planner.cost.terms.declare import SearchAxis, Term
from shardlib.planner.cost.terms.fsdp import vocab_tables
from shardlib.planner.cost.terms.pipeline_loop import layer_runs
from shardlib.planner.cost.terms.remat import saved_input_split, segmented
from shardlib.planner.cost.terms.tensor25d import grid_active

FORWARD_PER_LAYER = 2
BACKWARD_PER_LAYER = 2
RECOMPUTED_PER_LAYER = 1
"""Under full remat: the attention output's all-reduce, recomputed before the backward."""


def _admits(workload, cluster, chosen, size) -> bool:
    return math.gcd(*workload.tensor_sizes) % size == 0


SEARCH_AXIS = SearchAxis(
    Axis.TENSOR,
    placement=50,  # innermost: its all-reduces are on the critical path of every layer
    admits=_admits,
    largest=lambda cluster: cluster.devices_per_host,  # never across hosts unless asked
    rule="divides the heads, MLP and vocab widths (K/V heads: replicated where they do not) "
    "and stays inside one host",
)


def _unmodelled(view) -> str:
    if view.plan.tensor.sequence_parallel:
        return "tensor.sequence_parallel"
    return ""  # 2D, 2.5D and 3D: terms.tensor25d


def tensor(step: Step) -> Contribution:
    view, w = step.view, step.workload
    if view["tensor"] <= 1 or grid_active(view):  # 2D/2.5D: terms.tensor25d
        return Contribution()
    axes, t = (str(Axis.TENSOR),), view["tensor"]
    tokens = step.micro_batch * step.local_seq
    bsh = tokens * w.embed * w.compute_bytes
    m = view.microbatches  # the embedding's and the head's all-reduces, once per micro-batch:
    # the fused loops too run them only in their own trips, on every stage device at once
    # (stage 2 x fsdp 2 x tensor 2, interleaved 1F1B v=2 m=2: 3 embedding and 2 head
    # all-reduces compiled, where once per executed chunk booked 10)
    # full remat recomputes a layer up to the MLP: the attention all-reduce again (the MLP's
    # output all-reduce is not needed for the backward pass). The 1F1B schedule does so
    # whatever the policy: each layer's forward re-runs from its saved input right before
    # its backward (``stage_work``; compiled: 5 all-reduces per layer and executed chunk)
    forward = FORWARD_PER_LAYER
    if view.remat == "full" or view.schedule in FUSED_SCHEDULES:
        forward += RECOMPUTED_PER_LAYER
    if seg := segmented(view.remat):  # the segment's forward again, its inner recompute
        forward += FORWARD_PER_LAYER + (RECOMPUTED_PER_LAYER if seg[1] == "full" else 0)
    per_layer = (forward + BACKWARD_PER_LAYER) * layer_runs(step)  # with stages: loop trips
    if w.experts:  # an MoE block's MLP is its experts': the expert term's all-reduces
        per_layer -= (forward // 2 + 1) * layer_runs(step) / w.moe_every
    comms = [Comm("tensor", "activations", "all-reduce", axes, t, bsh, per_layer, False)]
    if saved_input_split(step) > 1:  # each layer's split input, gathered before its recompute
        gathers = layer_runs(step)
        comms.append(Comm("tensor", "saved inputs", "all-gather", axes, t, bsh, gathers, False))
    if not vocab_tables(step):  # else FSDP's vocab-parallel head runs them over fsdp x tensor
        comms += [
            Comm("tensor", "embedding", "all-reduce", axes, t, bsh, 2 * m, False),
            Comm("tensor", "softmax", "all-reduce", axes, t, tokens * 4, 3 * m, False),
        ]
    return Contribution(comms=tuple(comms))


TERM = Term(
    "tensor",
    cost=tensor,
    axis=SEARCH_AXIS,
    unmodelled=_unmodelled,
    exposed=lambda view: True,  # nothing overlaps its all-reduces
)
