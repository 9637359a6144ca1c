"""Context parallelism: the whole sequence dim split over a ``context`` axis.

Every activation's tokens (``seq`` inside blocks and ``res_seq`` between them) are split,
so each device holds s/N tokens of every layer's activations; the projections and the MLP
need no communication at all (weights are applied per token). Only attention mixes tokens,
and that is where the ``attention`` setting picks a kernel (shardlib/attention.py): ring
(K/V passed around with ppermute), all_to_all (Ulysses: heads <-> sequence) or all_gather.

Token order. Under a causal mask, with contiguous chunks device 0 attends to s/N keys and
device N-1 to all s, so ring attention would wait on the last device. With
``load_balance=true`` the loss function reorders each sequence once, before the embedding,
into the zig-zag order of ``zigzag_order`` (device i holds chunks i and 2N-1-i of 2N), and
reorders the targets the same way: the per-token losses are then a permutation of the
natural ones and their mean is unchanged, so nothing has to be undone afterwards. The true
positions travel with the tokens (``positions_L``) into RoPE and the causal mask.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp

from shardlib.attention import AttentionPlan, check_ulysses
from shardlib.errors import ShardingError
from shardlib.mesh import Axis
from shardlib.rules import Rules


def context_parallel(*, axis: str = Axis.CONTEXT) -> Rules:
    """Activation tokens (inside and between blocks) over ``axis``; parameters untouched."""
    return Rules(activations={"seq": (axis,), "res_seq": (axis,)})


def reorder_tokens(tokens_BL1, plan: AttentionPlan):
    """(inputs, targets, positions) of a [b, seq + 1] token batch in the plan's token order.

    Inputs and targets are reordered alike, so the mean loss is that of the natural order;
    positions are None for the natural order (the model then uses 0..L-1).
    """
    inputs_BL, targets_BL = tokens_BL1[:, :-1], tokens_BL1[:, 1:]
    order = plan.token_order(inputs_BL.shape[1])
    if order is None:
        return inputs_BL, targets_BL, None
    return inputs_BL[:, order], targets_BL[:, order], jnp.asarray(order, jnp.int32)


def attention_plan(cfg, mesh_axes: Mapping[str, int], rules: Rules, model_cfg) -> AttentionPlan:
    """The attention plan of a train config on a mesh, checked before anything compiles."""
    size = mesh_axes.get(Axis.CONTEXT)
    plan = AttentionPlan(
        context=cfg.attention if size is not None else "none",
        impl=cfg.attention_impl,
        chunk=cfg.attention_chunk,
        load_balance=cfg.load_balance,
        axis=Axis.CONTEXT,
        axis_size=size or 1,
    )
    if size is None:
        return plan
    if plan.context == "none":
        raise ShardingError(
            "the mesh has a context axis but attention=none. Fix: attention=ring, all_to_all "
            "or all_gather, or drop the context axis."
        )
    if plan.impl == "cudnn" and plan.context != "all_to_all":
        raise ShardingError(
            f"attention_impl=cudnn with attention={plan.context}: cuDNN's fused kernel takes "
            "whole, naturally ordered sequences only. Fix: attention=all_to_all, or "
            "attention_impl=dense|chunked."
        )
    plan.token_order(cfg.seq)  # raises when seq does not split into 2N zig-zag chunks
    if plan.context == "all_to_all":
        from jax.sharding import PartitionSpec as P

        def spec(name):
            axes = rules.activations.get(name, ())
            return P(None, None, axes or None)

        heads, kv_heads = model_cfg.heads, model_cfg.kv_heads
        axes = dict(mesh_axes)
        check_ulysses(heads, kv_heads, spec("heads"), spec("kv_heads"), axes, Axis.CONTEXT)
    return plan
