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
from dataclasses import dataclass
from typing import ClassVar

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardlib.attention import AttentionPlan, check_ulysses
from shardlib.errors import ShardingError
from shardlib.mesh import Axis
from shardlib.rules import Rules
from shardlib.target import Target


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


@dataclass(frozen=True)
class ContextParallel:
    """``[parallel.context]``: the sequence over a ``context`` axis, and the attention kernel."""

    axes: ClassVar[dict[str, str]] = {Axis.CONTEXT: "sequence split; attention across it"}
    logical_names: ClassVar[dict[str, str]] = {}

    attention: str = "ring"
    """Attention across the ``context`` axis: ring | all_to_all (Ulysses) | all_gather."""
    attention_impl: str = "dense"
    """Attention on each device: dense | chunked (online softmax) | cudnn (GPU only)."""
    attention_chunk: int = 512
    """Query/key block length of chunked attention (and of ring attention's inner blocks)."""
    load_balance: bool = True
    """Ring/all-gather attention: zig-zag token order so causal work is equal per device."""

    def __post_init__(self) -> None:
        # unknown kinds and bad chunks fail when the plan is made, not when it meets a mesh
        AttentionPlan(self.attention, self.attention_impl, self.attention_chunk)

    def rules(self, mesh_axes: Mapping[str, int]) -> list[Rules]:
        return [context_parallel(axis=Axis.CONTEXT)] if Axis.CONTEXT in mesh_axes else []

    def attention_plan(self, mesh_axes: Mapping[str, int]) -> AttentionPlan:
        """How ``shardlib.ops.attention`` runs on this mesh."""
        size = mesh_axes.get(Axis.CONTEXT)
        return AttentionPlan(
            context=self.attention if size is not None else "none",
            impl=self.attention_impl,
            chunk=self.attention_chunk,
            load_balance=self.load_balance,
            axis=Axis.CONTEXT,
            axis_size=size or 1,
        )

    def check(self, mesh_axes: Mapping[str, int], rules: Rules, target: Target) -> None:
        """Kernel, token order and Ulysses head counts, before anything compiles."""
        plan = self.attention_plan(mesh_axes)
        if plan.impl == "cudnn" and plan.context not in ("none", "all_to_all"):
            raise ShardingError(
                f"attention_impl=cudnn with attention={plan.context}: cuDNN's fused kernel takes "
                "whole, naturally ordered sequences only. Fix: attention=all_to_all, or "
                "attention_impl=dense|chunked."
            )
        if Axis.CONTEXT not in mesh_axes:
            return
        if plan.context == "none":
            raise ShardingError(
                "the mesh has a context axis but attention=none. Fix: attention=ring, "
                "all_to_all or all_gather, or drop the context axis."
            )
        if target.experts and mesh_axes.get(Axis.CONTEXT, 1) > 1:
            raise ShardingError(  # routing priorities follow token order within a sequence
                "a context axis splits and reorders each sequence, while the MoE router ranks "
                "a sequence's tokens in their natural order (capacity drops would change). "
                "Fix: drop the context axis (use expert/data/fsdp/tensor axes) for MoE models."
            )
        plan.token_order(target.seq)  # raises when seq does not split into 2N zig-zag chunks
        if plan.context == "all_to_all":

            def spec(name):
                axes = rules.activations.get(name, ())
                return P(None, None, axes or None)

            heads, kv_heads = target.dims.get("heads", 1), target.dims.get("kv_heads", 1)
            axes = dict(mesh_axes)
            check_ulysses(heads, kv_heads, spec("heads"), spec("kv_heads"), axes, Axis.CONTEXT)
