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

from shardlib.parallel.pipeline.spec import FUSED_SCHEDULES
from shardlib.planner.cost.terms.base import ADAM_BYTES, MASTER_BYTES, Contribution, Step, per_step
from shardlib.planner.cost.terms.declare import Term
from shardlib.planner.cost.terms.fsdp import layer_elements_gathered


@per_step
def optimizer_bytes(step: Step) -> float:
    """Adam's m and v on one device (ZeRO-1 and up shard them over ``data``)."""
    view = step.view
    return step.held_elements * ADAM_BYTES / (view["data"] if view.zero >= 1 else 1)


def state(step: Step) -> Contribution:
    view = step.view
    n = step.held_elements
    params = n * MASTER_BYTES
    opt = optimizer_bytes(step)
    # the step's computed gradients are whole before they are reduced, at every ZeRO stage
    # (XLA schedules the reduction after the backward pass); ZeRO-2 shards the accumulator
    grads = n * MASTER_BYTES
    # accumulation carries a sum of gradients; so does the 1F1B pipeline loop (all of them,
    # embedding and head too), GPipe/circular differentiate their loop and do not
    accumulates = view.microbatches > 1 if view["stage"] == 1 else view.schedule in FUSED_SCHEDULES
    accumulator = grads / (view["data"] if view.zero >= 2 else 1) if accumulates else 0.0
    # one layer's gradient as computed, before FSDP reduces it to its shard
    in_flight = layer_elements_gathered(step)
    # (1F1B adds each layer's into the accumulator as it is computed: ``stage_work``)
    in_flight *= step.calib["grad_layers_live"] * MASTER_BYTES
    # the optimizer update's temporaries, as sharded as the optimizer state (ZeRO-1 shrinks them)
    shards = view["data"] if view.zero >= 1 else 1
    update = step.calib["update_live"] * n * MASTER_BYTES / shards
    return Contribution(
        memory={
            "params": params,
            "optimizer": opt,
            "grads": grads + accumulator + in_flight + update,
        }
    )


TERM = Term("state", cost=state)
