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

_GATHERS_OUTSIDE = {"embedding": 1, "lm_head": 2, "final_norm.scale": 2}
_GATHERS_OUTSIDE_NO_TENSOR = {**_GATHERS_OUTSIDE, "lm_head": 1}


def fsdp(ctx: Context) -> Contribution:
    p, w = ctx.p, ctx.w
    if p.fsdp <= 1:
        return Contribution()
    axes, n = (str(Axis.FSDP),), p.fsdp
    m = p.microbatches if p.stage == 1 else 1
    grad_kind = "all-reduce" if ctx.backend == "cpu" else "reduce-scatter"
    comms, gathered_layer, gathered_outer = [], 0.0, 0.0
    weight_bytes = w.compute_bytes
    outside = _GATHERS_OUTSIDE if p.tensor > 1 else _GATHERS_OUTSIDE_NO_TENSOR
    for param in w.params:
        full = param.numel / ctx.shard(param, without=(str(Axis.FSDP),))  # after the gather
        if param.per_layer:
            gathers = 2 * ctx.layers_per_device
            gathered_layer += full * weight_bytes
        else:
            gathers = outside[param.name]
            gathered_outer += full * weight_bytes
        # outer gathers are loop-invariant: XLA hoists them out of the micro-batch loop
        repeat = m if param.per_layer else 1
        comms.append(
            Comm(
                "fsdp",
                "weights",
                "all-gather",
                axes,
                n,
                full * weight_bytes,
                gathers * repeat,
                True,
            )
        )
        grad = full * ctx.param_copies(param) * MASTER_BYTES
        comms.append(Comm("fsdp", "grads", grad_kind, axes, n, grad, m, True))
    c = ctx.calib
    transient = c["fsdp_layers_live"] * gathered_layer + c["fsdp_outer_live"] * gathered_outer
    if m > 1:  # accumulating: the outer weights' unreduced fp32 gradients stay live
        transient += gathered_outer / weight_bytes * MASTER_BYTES
    return Contribution(memory={"gathered weights": transient}, comms=tuple(comms))
