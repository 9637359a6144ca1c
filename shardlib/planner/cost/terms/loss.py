"""The chunked loss (``parallel.loss``): the head and cross-entropy in slices of the sequence.

Memory: the fp32 logits, their softmax and gradient are live for one slice at a time, so the
head's logits-sized buffers (``terms.model.head_activation_bytes``, GPipe's ``pipe_logits``)
are booked for ``chunk / seq`` of the head's tokens (``logits_share``); its h-wide buffers
stay whole (the slices are cut from the whole residual stream). FLOPs: the backward
recomputes each slice's logits, one more forward of the head per step. HBM traffic: the
softmax passes over the logits are the same in number, plus the recomputed logits' write,
which the added head FLOPs carry at the plan's rate (``throughput``).

Collectives (jax 0.10.2, CPU, checked with ``planner.validate``): data parallelism's
replicas sum the head's gradient once, after the slices (``parallel.loss.replica_axes``):
nothing is added. What the slices add:

* FSDP's vocab-parallel head: the head's input is gathered over ``fsdp`` once more, for
  the recompute;
* beside FSDP, the data replicas reduce the head's gradient shard once per slice (n - 1
  more reductions than without slices);
* a head FSDP gathers (under a pipeline, or where vocab-parallel does not pay): its weight
  is gathered once more per slice and its gradient reduced once per slice.
"""

from __future__ import annotations

from shardlib.core.mesh import Axis
from shardlib.parallel.pipeline.spec import FUSED_SCHEDULES
from shardlib.planner.cost.terms.base import MASTER_BYTES, Comm, Contribution, Step
from shardlib.planner.cost.terms.declare import Term
from shardlib.planner.cost.terms.fsdp import gathered, vocab_tables


def logits_share(step: Step) -> float:
    """The share of the head's tokens a slice holds: ``chunk / seq`` (1 when off)."""
    chunk = step.view.loss_chunk
    return chunk / step.workload.seq if chunk else 1.0


def _head_param(step: Step):
    """(the head's weight, ways split by the axes other than fsdp): ``lm_head``, or the
    embedding table a tied head reads."""
    table = {param.name: (param, ways) for param, ways in gathered(step)}
    return table.get("lm_head") or table.get("embedding")


def comms(step: Step) -> list[Comm]:
    """The collectives the slices add (the module docstring's cases)."""
    view, w = step.view, step.workload
    fsdp = view["fsdp"]
    head = _head_param(step)
    if fsdp <= 1 or head is None:
        return []
    slices = w.seq // view.loss_chunk
    per_step = view.microbatches if view["stage"] == 1 or view.schedule in FUSED_SCHEDULES else 1
    param, ways = head
    full = param.numel / ways  # the head's weight as FSDP gathers it
    axes = (str(Axis.FSDP),)
    if param.name in vocab_tables(step):
        rows = step.micro_batch * fsdp * step.local_seq * w.embed * w.compute_bytes
        out = [Comm("loss", "activations", "all-gather", axes, fsdp, rows, per_step, False)]
        if view["data"] > 1:  # the replicas reduce the head's gradient shard per slice
            shard = full / fsdp * MASTER_BYTES
            count = (slices - 1) * per_step
            data = (str(Axis.DATA),)
            out.append(Comm("loss", "grads", "all-reduce", data, view["data"], shard, count, True))
        return out
    kind = step.scatter_kind
    return [
        Comm("loss", "weights", "all-gather", axes, fsdp, full * w.compute_bytes, slices, True),
        Comm("loss", "grads", kind, axes, fsdp, full * MASTER_BYTES, slices - 1, True),
    ]


def loss(step: Step) -> Contribution:
    if not step.view.loss_chunk:
        return Contribution()
    w = step.workload
    recompute = step.tokens * w.head_flops_per_token / step.view["tensor"]
    return Contribution(flops=recompute, comms=tuple(comms(step)))


TERM = Term(
    "loss",
    cost=loss,
    settings=lambda view: {"loss_chunk": view.plan.loss.chunk},
    knobs_text=lambda view: f"loss_chunk={view.loss_chunk}" if view.loss_chunk else "",
    logits_share=logits_share,
)
