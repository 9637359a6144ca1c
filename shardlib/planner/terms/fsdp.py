"""FSDP (ZeRO-3): weights gathered just in time, gradients reduced to their shards.

Per micro-batch, each layer's weights are all-gathered over the ``fsdp`` axis in the forward
pass and again in the backward pass (XLA does not keep the gathered copy across the scan),
and each layer's gradient is reduced: REFERENCE.md's 3Ψ on the wire against DP's 2Ψ. The
GPU/TPU pipelines emit a reduce-scatter; the CPU backend an all-reduce of the full gradient
followed by a slice (2x the wire bytes of a reduce-scatter), which is what ``backend="cpu"``
predicts. Outside the layer loop the compiled program gathers the embedding table once (its
lookup wants it whole along ``embed``) and the final norm in forward and backward; the
output projection twice when it is also tensor-split, but once when it is not (XLA keeps
the gathered copy for the backward pass then: observed on jax 0.10.2, CPU). Gathered
weights live briefly: the embedding and head copies are the transient memory.
"""

from __future__ import annotations

from shardlib.mesh import Axis
from shardlib.planner.terms.base import MASTER_BYTES, Comm, Context, Contribution
from shardlib.planner.terms.pipeline import gradient_reductions

_GATHERS_OUTSIDE = {"embedding": 1, "lm_head": 2, "final_norm.scale": 2}
_GATHERS_OUTSIDE_NO_TENSOR = {**_GATHERS_OUTSIDE, "lm_head": 1}


def fsdp(ctx: Context) -> Contribution:
    p, w = ctx.p, ctx.w
    if p.fsdp <= 1:
        return Contribution()
    axes, n = (str(Axis.FSDP),), p.fsdp
    m = p.microbatches if p.stage == 1 else 1
    # with stages a device's L/p blocks are the same every loop trip: XLA hoists their
    # gathers out of the pipeline loop (once forward, once backward), while gradients are
    # reduced inside it (``pipeline.gradient_reductions``)
    layer_grads, outer_grads = gradient_reductions(ctx)
    grad_kind = "all-reduce" if ctx.backend == "cpu" else "reduce-scatter"
    weight_bytes = w.compute_bytes
    outside = _GATHERS_OUTSIDE if p.tensor > 1 else _GATHERS_OUTSIDE_NO_TENSOR
    # the per-layer tensors travel as separate collectives: listed once, ``ops`` of them
    layer = [param.numel / ways for param, _, ways in ctx.table if param.per_layer]
    gathered_layer = sum(layer) * weight_bytes
    comms = [
        Comm(
            "fsdp",
            "weights",
            "all-gather",
            axes,
            n,
            gathered_layer,
            2 * ctx.layers_per_device * m,
            True,
            len(layer),
        ),
        # a layer's gradients leave together, once per layer and micro-batch
        Comm(
            "fsdp",
            "grads",
            grad_kind,
            axes,
            n,
            sum(layer) * MASTER_BYTES,
            layer_grads,
            True,
        ),
    ]
    gathered_outer = 0.0
    for param, _, ways in ctx.table:
        if param.per_layer:
            continue
        full = param.numel / ways  # after the gather
        gathered_outer += full * weight_bytes
        # outer gathers are loop-invariant: XLA hoists them out of the micro-batch loop
        comms.append(
            Comm(
                "fsdp",
                "weights",
                "all-gather",
                axes,
                n,
                full * weight_bytes,
                outside[param.name],
                True,
            )
        )
        comms.append(
            Comm("fsdp", "grads", grad_kind, axes, n, full * MASTER_BYTES, outer_grads, True)
        )
    c = ctx.calib
    transient = c["fsdp_layers_live"] * gathered_layer + c["fsdp_outer_live"] * gathered_outer
    if m > 1:  # accumulating: the outer weights' unreduced fp32 gradients stay live
        transient += gathered_outer / weight_bytes * MASTER_BYTES
    return Contribution(memory={"gathered weights": transient}, comms=tuple(comms))
