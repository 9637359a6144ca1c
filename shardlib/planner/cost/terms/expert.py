"""Expert parallelism: tokens go to the devices holding their experts and come back.

``models/moe/model.py`` routes fixed groups of tokens (a sequence, or ``group_size`` tokens) and
moves the dispatched buffer [groups, experts, capacity, embed] from a split over groups to a
split over experts: one all-to-all over the expert axis to dispatch and one to combine in
forward, and the two transposed ones in backward, 4 per MoE layer and micro-batch (GShard;
REFERENCE.md). Each moves the device's whole buffer, b/G groups x E x C slots x embed,
where C = ``MoeConfig.capacity(group)`` (padded slots travel too): that is k x b x s x h x
the effective capacity factor E·C/(k·group), the formula ``benchmarks/moe.py`` measures
exactly (fp32; on CPU a bf16 run moves fp32 buffers). They sit on the critical path.
Expert weights are split over the axis by the layout (``terms.base.param_splits``), so they
cost no gathers; the other weights are replicated over it and their gradients reduced
over it (``reductions``). With tensor parallelism the experts' hidden width is split, and
the MoE block's MLP all-reduces act on the dispatched buffer instead of b·s·h. An MoE
block saves its dispatched buffers instead of the dense MLP's activations (``saved``,
``working``).
"""

from __future__ import annotations

from typing import Any

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import Axis
from shardlib.core.param_info import ParamInfo
from shardlib.parallel.plan import ParallelPlan
from shardlib.planner.cost.terms.base import MASTER_BYTES, Comm, Contribution, Step
from shardlib.planner.cost.terms.declare import SearchAxis, Term
from shardlib.planner.cost.terms.pipeline_loop import layer_runs

EXPERT = str(Axis.EXPERT)

# Activations of an MoE model per token. What the compiled step keeps per MoE block (XLA's
# buffer assignment of moe-tiny, 4 MoE blocks, data=2 x expert=4): six buffers of the
# experts' hidden width per slot ([groups, experts, capacity, expert_mlp]: gate, up, their
# SwiGLU product and what its backward needs), two dispatched buffers [.., capacity, embed],
# routing tensors (three of k·E·C and two of E·C per token) and the attention's. Those
# stacked residuals fill the temp allocation, and the gradients and loss buffers reuse their
# space as the backward pass frees it, so the counts are fitted rather than added up, on the
# MoE probes of ``calibrate.probes.PROBES`` (``moe_slot_hidden``: elements of width
# expert_mlp / tensor saved per expert slot per MoE block, in place of the dense MLP's
# ``layer_mlp``: the buffer assignment shows six; ``moe_working_hidden``: the same, live once
# for one block's backward; ``moe_dense_mlp``: extra elements of width mlp / tensor per dense
# block of an MoE model, which runs unrolled inside the scanned group of ``moe_every``).
# A model with one scanned group (layers = moe_every) compiles far smaller (XLA unrolls the
# one-trip loop): over-predicted (1.4-1.5x), not fitted, and not searched differently.


def _admits(workload, cluster, chosen, size) -> bool:
    return bool(workload.experts) and workload.experts % size == 0


def _check(workload, view) -> None:
    if not workload.experts or workload.experts % view[EXPERT]:
        raise ShardingError(
            f"plan {view.mesh_text()}: {workload.experts} experts do not split over "
            f"expert={view[EXPERT]}. Fix: an expert size that divides the expert count."
        )


SEARCH_AXIS = SearchAxis(
    Axis.EXPERT,
    placement=30,  # per-layer all-to-alls: inside, next to context
    admits=_admits,
    splits=("batch",),  # each expert-axis device routes its own rows
    rule="divides the expert count (MoE models only)",
    check=_check,
)


def moe_saved_elements(step: Step) -> float:
    """Elements an MoE block's expert half saves per token (replaces the dense MLP's)."""
    w, view = step.workload, step.view
    return step.calib["moe_slot_hidden"] * w.slots_per_token * w.expert_mlp / view["tensor"]


def moe_working_bytes(step: Step, micro_batch: int) -> float:
    """One MoE block's backward working set, live once."""
    w, view = step.workload, step.view
    if not w.experts:
        return 0.0
    tokens = micro_batch * step.local_seq
    hidden = w.slots_per_token * w.expert_mlp / view["tensor"]
    return step.calib["moe_working_hidden"] * tokens * hidden * w.compute_bytes


def dispatched_elements(step: Step, micro_batch: int) -> float:
    """Elements of one device's dispatched buffer [groups, experts, capacity, embed]."""
    w = step.workload
    groups = micro_batch * w.seq / w.group_tokens
    return groups * w.experts * w.capacity * w.embed


def expert(step: Step) -> Contribution:
    view, w = step.view, step.workload
    if not w.experts:
        return Contribution()
    buffer = dispatched_elements(step, step.micro_batch) * w.compute_bytes
    runs = layer_runs(step) / w.moe_every  # MoE layer executions (a pipeline's bubble too)
    comms = []
    if view[EXPERT] > 1:
        axes = (EXPERT,)
        comms.append(
            Comm("expert", "tokens", "all-to-all", axes, view[EXPERT], buffer, 4 * runs, False)
        )
    if view["tensor"] > 1:
        # the experts' hidden width is split by tensor: the w_down product's output buffer is
        # all-reduced in forward (again when full remat recomputes it), and in backward the
        # input gradients of w_gate and w_up (two einsums, one all-reduce of both)
        axes, t = (str(Axis.TENSOR),), view["tensor"]
        forward = 2 if view.remat == "full" else 1
        comms += [
            Comm("expert", "expert output", "all-reduce", axes, t, buffer, forward * runs, False),
            Comm("expert", "expert input grad", "all-reduce", axes, t, 2 * buffer, runs, False),
        ]
    return Contribution(comms=tuple(comms))


def _saved(step: Step, policy: str, kept) -> dict[str, Any]:
    """An MoE model's MLP part: its dense blocks between MoE blocks, and each MoE block's
    routed buffers (nothing under full remat: only the layer input is kept)."""
    w = step.workload
    if not w.experts:
        return {}
    if policy == "full":
        return {"mlp": ()}
    moe, t = 1.0 / w.moe_every, step.view["tensor"]
    dense = (1 - moe) * (kept["mlp"] + step.calib["moe_dense_mlp"]) * w.mlp / t
    return {"mlp": (dense, moe * moe_saved_elements(step))}


def _reductions(step: Step, param: ParamInfo) -> tuple:
    """The expert axis folds into the batch: it replicates what it does not split. Under
    pipeline stages the data axis runs as replicas (reduced once, after the loop) and the
    expert axis inside them: the blocks' reduction of its own, per loop trip."""
    if EXPERT in step.splits[param.name]:
        return ()
    view = step.view
    if view["stage"] > 1 and view.zero < 3 and param.per_layer:  # (the rest: after it)
        return (((EXPERT,), param.numel / step.shard(param) * MASTER_BYTES),)
    return (((EXPERT,), None),)


_DEFAULT = ParallelPlan().expert


def _unmodelled(view) -> str:
    if view.plan.expert != _DEFAULT:
        return f"expert.dispatch={view.plan.expert.dispatch}"
    return ""


TERM = Term(
    "expert",
    cost=expert,
    axis=SEARCH_AXIS,
    unmodelled=_unmodelled,
    reductions=_reductions,
    saved=_saved,
    working=moe_working_bytes,
    exposed=lambda view: True,  # the all-to-alls sit on the critical path
)
