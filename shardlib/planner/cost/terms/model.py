"""The model's own share: FLOPs and the activations the backward pass needs.

FLOPs per device are 3x the forward matmuls (forward, two backward matmuls), split over
every axis that splits tokens (data, FSDP, expert, context) or weights (tensor), plus the
forward that rematerialisation repeats. Saved activations follow Korthikanti et al. 2022:
per layer, per token, some elements of width h (norm inputs, residual: not split by tensor
parallelism), some of the q/k/v and MLP widths (split by tensor), and the attention scores
(a·s per token, split by tensor). The element counts are fitted to compiled programs
(``planner.calibration``) instead of assumed, because XLA's fusion decides what is saved.
Ring attention (context parallelism) keeps no score matrix: its own counts live in
``terms.context``; an MoE block saves its dispatched buffers instead of the dense MLP's
(``terms.expert``).
"""

from __future__ import annotations

from shardlib.planner.cost.terms import context, expert, remat
from shardlib.planner.cost.terms.base import Context, Contribution


def flops(ctx: Context) -> Contribution:
    w, p = ctx.w, ctx.p
    tokens = w.tokens / (p.batch_ways * p.context)
    unsplit = w.layer_unsplit_flops_per_token  # MoE routing: not split by tensor
    layer = (w.layer_matmul_flops_per_token - unsplit) / p.tensor + unsplit
    attn = w.attention_flops_per_token(w.seq) / p.tensor
    forward = tokens * (ctx.layers_per_device * (layer + attn) + w.head_flops_per_token / p.tensor)
    extra = remat.recompute_flops(ctx, tokens, layer, attn)
    return Contribution(flops=3 * forward + extra)


def layer_activation_bytes(
    ctx: Context, micro_batch: int, policy: str | None = None, *, scores: bool = True
) -> float:
    """Bytes one layer saves for backward on one device, for one micro-batch (``scores``:
    with the attention scores' part)."""
    w, p, c = ctx.w, ctx.p, ctx.calib
    tokens = micro_batch * ctx.local_seq
    policy = p.remat if policy is None else policy
    k = remat.saved_coefficients(policy, c)
    if policy == "full":  # the kept input, split over tensor (terms.remat.saved_input_split)
        k["h"] -= remat.KEPT["full"]["h"] * (1 - 1 / remat.saved_input_split(ctx))
    if not scores or p.fused_attention:  # a fused kernel saves its output and row statistics
        k["scores"] = 0.0
    qkv = (w.heads + 2 * w.kv_heads) * w.head_dim
    if p.context > 1:  # ring attention saves no score matrix: its own count (terms.context)
        attention = c["ring_saved_qkv"] * qkv / p.tensor if policy == "none" else 0.0
    else:
        attention = k["scores"] * w.heads * w.seq / p.tensor
    elems = k["h"] * w.embed + k["qkv"] * qkv / p.tensor + attention
    if not w.experts:
        elems += k["mlp"] * w.mlp / p.tensor
    else:  # dense blocks between MoE blocks; an MoE block saves its routed buffers
        moe = 1.0 / w.moe_every
        if policy != "full":
            elems += (1 - moe) * (k["mlp"] + c["moe_dense_mlp"]) * w.mlp / p.tensor
            elems += moe * expert.moe_saved_elements(ctx)
    return tokens * elems * w.compute_bytes


def head_activation_bytes(ctx: Context, micro_batch: int) -> float:
    """Logits (fp32: the model casts them up), their softmax and gradient, and the embedding."""
    w, p, c = ctx.w, ctx.p, ctx.calib
    tokens = micro_batch * ctx.local_seq
    return tokens * (c["head_vocab"] * w.vocab / p.tensor * 4 + c["head_h"] * w.embed * 4)


def activations(ctx: Context, in_flight: float = 1, head_batch: int | None = None) -> Contribution:
    """Saved activations of ``in_flight`` micro-batches (1, or a pipeline's), per device.

    ``head_batch``: sequences the loss head runs on at once (a pipeline runs it outside its
    loop, on the whole data shard); one micro-batch when None.
    """
    b = ctx.micro_batch
    per_layer = layer_activation_bytes(ctx, b)
    saved = per_layer * ctx.layers_per_device * in_flight
    working = 0.0
    w, p, c = ctx.w, ctx.p, ctx.calib
    if p.remat != "none" and p.context == 1 and not p.fused_attention:
        # the recomputed probabilities of one layer are live again (ring attention and a
        # fused kernel keep no score matrix)
        scores = w.heads * ctx.local_seq / p.tensor
        working = c["remat_scores"] * b * ctx.local_seq * scores * w.compute_bytes
    if p.remat == "full":  # and the rest of the recomputed layer: part of the none set
        working += c["full_layer_live"] * layer_activation_bytes(ctx, b, "none", scores=False)
    working += context.ring_working_bytes(ctx, b) + expert.moe_working_bytes(ctx, b)
    return Contribution(
        memory={
            "activations": saved + working,
            "logits": head_activation_bytes(ctx, b if head_batch is None else head_batch),
        }
    )
