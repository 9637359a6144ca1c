"""The chunked loss (``parallel.loss``): the head and cross-entropy in slices of the sequence.

Memory: the fp32 logits, their softmax and gradient are live for one slice at a time, so the
head's logits-sized buffers (``terms.model.head_activation_bytes``, GPipe's ``pipe_logits``)
are booked for ``chunk / seq`` of the head's tokens (``logits_share``); its h-wide buffers
stay whole (the slices are cut from the whole residual stream). FLOPs: the backward
recomputes each slice's logits, one more forward of the head per step. HBM traffic: the
softmax passes over the logits are the same in number, plus the recomputed logits' write,
which the added head FLOPs carry at the plan's rate (``throughput``).

Not booked: where a device gathers the head's weight (FSDP without its vocab-parallel head,
a pipeline's head) or reduces its gradient over batch replicas, XLA runs that collective
once per slice inside the loop (measured on jax 0.10.2, CPU: fsdp 8, vocab 32768, 8 slices:
the head's gather and its gradient's reduction 8 times instead of once).
"""

from __future__ import annotations

from shardlib.planner.cost.terms.base import Contribution, Step, Term


def logits_share(step: Step) -> float:
    """The share of the head's tokens a slice holds: ``chunk / seq`` (1 when off)."""
    chunk = step.view.loss_chunk
    return chunk / step.workload.seq if chunk else 1.0


def loss(step: Step) -> Contribution:
    if not step.view.loss_chunk:
        return Contribution()
    w = step.workload
    return Contribution(flops=step.tokens * w.head_flops_per_token / step.view["tensor"])


TERM = Term(
    "loss",
    cost=loss,
    settings=lambda view: {"loss_chunk": view.plan.loss.chunk},
    knobs_text=lambda view: f"loss_chunk={view.loss_chunk}" if view.loss_chunk else "",
    logits_share=logits_share,
)
