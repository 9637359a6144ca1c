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
over it (``terms.dp``). With tensor parallelism the experts' hidden width is split, and
the MoE block's MLP all-reduces act on the dispatched buffer instead of b·s·h.
"""

from __future__ import annotations

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import Axis
from shardlib.planner.cost.terms.base import Comm, Context, Contribution, SearchAxis

# Activations of an MoE model per token. What the compiled step keeps per MoE block (XLA's
# buffer assignment of moe-tiny, 4 MoE blocks, data=2 x expert=4): six buffers of the
# experts' hidden width per slot ([groups, experts, capacity, expert_mlp]: gate, up, their
# SwiGLU product and what its backward needs), two dispatched buffers [.., capacity, embed],
# routing tensors (three of k·E·C and two of E·C per token) and the attention's. Those
# stacked residuals fill the temp allocation, and the gradients and loss buffers reuse their
# space as the backward pass frees it, so the counts are fitted rather than added up, on the
# MoE probes of ``planner.calibration.PROBES`` (``moe_slot_hidden``: elements of width
# expert_mlp / tensor saved per expert slot per MoE block, in place of the dense MLP's
# ``layer_mlp``: the buffer assignment shows six; ``moe_working_hidden``: the same, live once
# for one block's backward; ``moe_dense_mlp``: extra elements of width mlp / tensor per dense
# block of an MoE model, which runs unrolled inside the scanned group of ``moe_every``).
# A model with one scanned group (layers = moe_every) compiles far smaller (XLA unrolls the
# one-trip loop): over-predicted (1.4-1.5x), not fitted, and not searched differently.


def _admits(workload, cluster, space, chosen, size) -> bool:
    return bool(workload.experts) and workload.experts % size == 0


def _check(workload, view) -> None:
    if not workload.experts or workload.experts % view.expert:
        raise ShardingError(
            f"plan {view.mesh_text()}: {workload.experts} experts do not split over "
            f"expert={view.expert}. Fix: an expert size that divides the expert count."
        )


SEARCH_AXIS = SearchAxis(
    Axis.EXPERT,
    placement=30,  # per-layer all-to-alls: inside, next to context
    admits=_admits,
    splits_batch=True,  # each expert-axis device routes its own rows
    rule="divides the expert count (MoE models only)",
    check=_check,
)


def moe_saved_elements(ctx: Context) -> float:
    """Elements an MoE block's expert half saves per token (replaces the dense MLP's)."""
    w, p = ctx.w, ctx.p
    return ctx.calib["moe_slot_hidden"] * w.slots_per_token * w.expert_mlp / p.tensor


def moe_working_bytes(ctx: Context, micro_batch: int) -> float:
    """One MoE block's backward working set, live once."""
    w, p = ctx.w, ctx.p
    if not w.experts:
        return 0.0
    tokens = micro_batch * ctx.local_seq
    hidden = w.slots_per_token * w.expert_mlp / p.tensor
    return ctx.calib["moe_working_hidden"] * tokens * hidden * w.compute_bytes


def dispatched_elements(ctx: Context, micro_batch: int) -> float:
    """Elements of one device's dispatched buffer [groups, experts, capacity, embed]."""
    w = ctx.w
    groups = micro_batch * w.seq / w.group_tokens
    return groups * w.experts * w.capacity * w.embed


def expert(ctx: Context) -> Contribution:
    p, w = ctx.p, ctx.w
    if not w.experts:
        return Contribution()
    buffer = dispatched_elements(ctx, ctx.micro_batch) * w.compute_bytes
    runs = ctx.layer_runs / w.moe_every  # MoE layer executions (a pipeline's bubble too)
    comms = []
    if p.expert > 1:
        axes = (str(Axis.EXPERT),)
        comms.append(
            Comm("expert", "tokens", "all-to-all", axes, p.expert, buffer, 4 * runs, False)
        )
    if p.tensor > 1:
        # the experts' hidden width is split by tensor: the w_down product's output buffer is
        # all-reduced in forward (again when full remat recomputes it), and in backward the
        # input gradients of w_gate and w_up (two einsums, one all-reduce of both)
        axes, t = (str(Axis.TENSOR),), p.tensor
        forward = 2 if p.remat == "full" else 1
        comms += [
            Comm("expert", "expert output", "all-reduce", axes, t, buffer, forward * runs, False),
            Comm("expert", "expert input grad", "all-reduce", axes, t, 2 * buffer, runs, False),
        ]
    return Contribution(comms=tuple(comms))
