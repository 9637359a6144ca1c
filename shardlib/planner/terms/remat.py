"""Rematerialisation: save less in the forward pass, recompute it in the backward pass.

Formula-only until rematerialisation (issue 6) lands: the saved-element counts below scale
the fitted ``none`` coefficients the way Korthikanti et al. 2022 describe, and are not yet
checked against a compiled program.

- ``selective``: drop the attention scores and softmax (the a·s/t part, the largest at long
  sequence) and recompute the attention forward: about 2·a·s·d FLOPs extra per token.
- ``full``: keep only each layer's input (b·s·h, REFERENCE.md's "full recompute 2sbh" in
  fp16 bytes) and recompute the whole layer forward: about one extra forward pass (~33%).
"""

from __future__ import annotations

from shardlib.planner.terms.base import Context


def saved_coefficients(policy: str, calib: dict) -> dict[str, float]:
    """Elements saved per token per layer, by width (see ``terms.model``)."""
    fitted = {k: calib[f"layer_{k}"] for k in ("h", "qkv", "mlp", "scores")}
    if policy == "none":
        return fitted
    if policy == "selective":
        return {**fitted, "scores": 0.0}
    if policy == "full":
        return {"h": 1.0, "qkv": 0.0, "mlp": 0.0, "scores": 0.0}
    raise ValueError(f"unknown remat policy {policy!r}")


def recompute_flops(ctx: Context, tokens: float, layer_flops: float, attn_flops: float) -> float:
    """FLOPs the backward pass spends recomputing forward work, per device per step."""
    policy, layers = ctx.p.remat, ctx.layers_per_device
    if policy == "selective":
        return tokens * layers * attn_flops
    if policy == "full":
        return tokens * layers * (layer_flops + attn_flops)
    return 0.0
