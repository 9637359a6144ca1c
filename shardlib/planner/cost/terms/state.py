"""Parameters, gradients and optimizer state: what each device holds between steps.

Every parameter is split by the axes the rules give it (FSDP on ``embed``, tensor on heads,
kv-heads, MLP and vocab, expert on ``expert``); a pipeline stage holds only its L/p layers
(and, outside the pipeline, the embedding and head).
fp32 master weights (4 bytes), fp32 gradients (4) and Adam's m and v (8), as shardlib
trains (REFERENCE.md's 16 bytes per parameter, Megatron's "fp32 params and grads"). ZeRO-1
divides the optimizer state by the data-parallel degree. ZeRO-2 divides the gradient
accumulator (with micro-batches it sits next to each micro-batch's gradients), but not the
gradients of one micro-batch: shardlib's step has no gradient buffer that outlives it, and
the compiled program holds a micro-batch's gradients whole until they are reduced, so
without micro-batches ZeRO-2 uses what ZeRO-1 does (compiled: equal to the byte).
"""

from __future__ import annotations

from shardlib.planner.cost.terms.base import ADAM_BYTES, MASTER_BYTES, Context, Contribution


def state(ctx: Context) -> Contribution:
    p = ctx.p
    n = ctx.held_elements
    params = n * MASTER_BYTES
    opt = n * ADAM_BYTES / (p.data if p.zero >= 1 else 1)
    # the step's computed gradients are whole before they are reduced, at every ZeRO stage
    # (XLA schedules the reduction after the backward pass); ZeRO-2 shards the accumulator
    grads = n * MASTER_BYTES
    # accumulation carries a sum of gradients; so does the 1F1B pipeline loop (all of them,
    # embedding and head too), GPipe/circular differentiate their loop and do not
    accumulates = p.microbatches > 1 if p.stage == 1 else p.schedule == "1f1b"
    accumulator = grads / (p.data if p.zero >= 2 else 1) if accumulates else 0.0
    # one layer's gradient as computed, before FSDP reduces it to its shard
    in_flight = ctx.layer_elements_gathered
    live = ctx.calib["grad_layers_live"]
    if p.stage > 1 and p.schedule == "1f1b":  # a stage's vjp returns all its L/p layers' at once
        live += ctx.layers_per_device - 1
    in_flight *= live * MASTER_BYTES
    # the optimizer update's temporaries, as sharded as the optimizer state (ZeRO-1 shrinks them)
    update = ctx.calib["update_live"] * n * MASTER_BYTES / (p.data if p.zero >= 1 else 1)
    return Contribution(
        memory={
            "params": params,
            "optimizer": opt,
            "grads": grads + accumulator + in_flight + update,
        }
    )
