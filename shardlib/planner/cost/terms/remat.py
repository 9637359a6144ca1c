"""Rematerialisation: save less in the forward pass, recompute it in the backward pass.

The policies are the trainer's (``shardlib/parallel/remat.py``). What each one keeps is,
first, the buffers the policy keeps by definition (``KEPT``, elements per token per layer
by width, in the compute dtype), and on top of them what XLA's fusion keeps besides,
fitted to compiled programs (``planner.calibration``: the ``selective_*``/``full_*``
coefficients are these extras, non-negative):

- ``selective`` (Korthikanti et al. 2022; ``dots_with_no_batch_dims_saveable``): the outputs
  of the projections the backward needs: q, k, v (the q/k/v width, split by tensor), the
  MLP's gate and up (2 x mlp, split), and the attention output projection's, whose width is
  h *whatever the tensor degree* (the row-parallel product before its all-reduce), plus the
  layer input the scan keeps: 2h that tensor parallelism does not shrink. Fitting these
  counts on tensor 1-2 probes hid the h part in the MLP count and under-predicted tensor 8
  by 1.76x (issue 15). The scores and softmax are dropped; the backward recomputes q·kᵀ
  and the softmax: half the attention forward, 2·a·s·d FLOPs per token.
- ``full``: the layer input only (REFERENCE.md's "full recompute 2sbh" in fp16 bytes), and
  the whole layer forward again: about one extra forward pass (~33%). Outside a pipeline
  and context parallelism the trainer keeps that input split over ``tensor`` too
  (``strategies.remat.partition_saved_inputs``): h/t per token (``saved_input_split``).

Either way one layer's recomputed intermediates are live while its backward runs
(``working_bytes``): the attention probabilities (``remat_scores``) and, under ``full``,
the rest of the layer's residuals (``full_layer_live``: a fraction of the ``none`` set).
"""

from __future__ import annotations

from shardlib.planner.cost.terms.base import Context

KEPT: dict[str, dict[str, float]] = {
    "selective": {"h": 2.0, "qkv": 1.0, "mlp": 2.0},
    "full": {"h": 1.0},
}
"""Elements per token per layer a policy keeps by definition, by width (see the docstring)."""


def saved_coefficients(policy: str, calib: dict) -> dict[str, float]:
    """Elements saved per token per layer, by width (see ``terms.model``)."""
    fitted = {k: calib[f"layer_{k}"] for k in ("h", "qkv", "mlp", "scores")}
    if policy == "none":
        return fitted
    if policy in KEPT:
        kept = KEPT[policy]
        return {k: kept[k] + calib.get(f"{policy}_{k}", 0.0) if k in kept else 0.0 for k in fitted}
    raise ValueError(f"unknown remat policy {policy!r}")


def saved_input_split(ctx: Context) -> int:
    """Ways ``full`` keeps a layer's input split beyond the residual stream's own layout:
    the tensor degree where ``partition_saved_inputs`` applies (no pipeline stages, no
    context split of the tokens; the planner searches no sequence parallelism), else 1."""
    p = ctx.p
    return p.tensor if p.remat == "full" and p.stage == 1 and p.context == 1 else 1


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
