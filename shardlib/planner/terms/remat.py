"""Rematerialisation: save less in the forward pass, recompute it in the backward pass.

The policies are the trainer's (``shardlib/strategies/remat.py``); what each one keeps is
fitted to compiled programs like the ``none`` counts (``planner.calibration``), because
XLA's fusion decides which buffers a policy really saves:

- ``selective`` (Korthikanti et al. 2022): keep the projections' outputs, drop the attention
  scores and softmax (the a·s/t part, the largest at long sequence); the backward pass
  recomputes q·kᵀ and the softmax: half the attention forward, 2·a·s·d FLOPs per token.
- ``full``: keep each layer's input (REFERENCE.md's "full recompute 2sbh" in fp16 bytes)
  and recompute the whole layer forward: about one extra forward pass (~33%).

Either way one layer's recomputed intermediates are live while its backward runs: the
attention probabilities dominate at long sequence (``remat_scores``, fitted).
"""

from __future__ import annotations

from shardlib.planner.terms.base import Context


def saved_coefficients(policy: str, calib: dict) -> dict[str, float]:
    """Elements saved per token per layer, by width (see ``terms.model``)."""
    fitted = {k: calib[f"layer_{k}"] for k in ("h", "qkv", "mlp", "scores")}
    if policy == "none":
        return fitted
    if policy in ("selective", "full"):
        widths = ("h", "qkv", "mlp") if policy == "selective" else ("h",)
        return {k: calib.get(f"{policy}_{k}", 0.0) if k in widths else 0.0 for k in fitted}
    raise ValueError(f"unknown remat policy {policy!r}")


def recompute_flops(ctx: Context, tokens: float, layer_flops: float, attn_flops: float) -> float:
    """FLOPs the backward pass spends recomputing forward work, per device per step.

    Ring attention (a context axis) recomputes each block's probabilities in its backward
    whatever the policy (``kernels/ring_attention.py``): q·kᵀ again, as selective does.
    """
    policy, layers = ctx.p.remat, ctx.layers_per_device
    extra = 0.0
    if policy == "selective" or ctx.p.context > 1:  # q·kᵀ: half the attention FLOPs
        extra += tokens * layers * attn_flops / 2
    if policy == "full":
        extra += tokens * layers * (layer_flops + attn_flops)
    return extra
