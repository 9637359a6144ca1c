"""Expert parallelism: tokens go to the devices holding their experts and come back.

``models/moe.py`` routes fixed groups of tokens (a sequence, or ``group_size`` tokens) and
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

from shardlib.mesh import Axis
from shardlib.planner.terms.base import Comm, Context, Contribution

# Activations of an MoE block per token (models/moe.py), in expert slots (E·C/g per token,
# k x the effective capacity factor): the dispatched buffers [groups, experts, capacity,
# embed] around the all-to-alls and the experts are saved per MoE block, with some of the
# experts' SwiGLU hidden [.., capacity, expert_mlp/t]; one block's expert backward keeps a
# larger hidden-width working set, once. These replace the dense MLP's ``layer_mlp`` count.
MOE_SLOT_EMBED = 5.218
"""Elements of width embed saved per expert slot per MoE block."""
MOE_SLOT_HIDDEN = 1.722
"""Elements of width expert_mlp / tensor saved per expert slot per MoE block."""
MOE_WORK_HIDDEN = 17.057
"""Elements of width expert_mlp / tensor per expert slot live once (one block's backward)."""
# Fitted (least squares on the relative error, calibration.COEFFICIENTS fixed) on 7 probes,
# 8 CPU devices, fp32, moe-tiny with embed 256, mlp 1024, 8 heads of 32 (4 kv), layers 4,
# batch 16, capacity factor 2, top_k 2: expert=8 (seq 128 and 256; expert_mlp 512 and 1024;
# moe_every 2 and 1), data=2 x expert=4, expert=4 x tensor=2, data=8. Residuals -2.0% to
# +2.2%; held out fsdp=2 x expert=4: 1.013. The feature sets tried (per block or once, of
# widths embed, expert_mlp and the routing tensors' E·C) and this one fit best; the routing
# tensors [groups, tokens, experts, capacity] did not improve the fit.


def moe_saved_elements(ctx: Context) -> float:
    """Elements an MoE block's expert half saves per token (replaces the dense MLP's)."""
    w, p = ctx.w, ctx.p
    slots = w.slots_per_token
    return slots * (MOE_SLOT_EMBED * w.embed + MOE_SLOT_HIDDEN * w.cfg.expert_mlp / p.tensor)


def moe_working_bytes(ctx: Context, micro_batch: int) -> float:
    """One MoE block's backward working set, live once."""
    w, p = ctx.w, ctx.p
    if not w.experts:
        return 0.0
    tokens = micro_batch * ctx.local_seq
    hidden = w.slots_per_token * w.cfg.expert_mlp / p.tensor
    return MOE_WORK_HIDDEN * tokens * hidden * w.compute_bytes


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
    runs = ctx.layers_per_device / w.moe_every * p.microbatches  # MoE layer executions
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
