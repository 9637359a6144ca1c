"""DeepSpeed ZeRO-3's program as of 2021: what Narayanan et al. 2021 (SC21) Table 2 ran.

SC21's Table 2 compares PTD-P with "ZeRO-3 without model parallelism" (175B, 384-1536
A100s). Costed as shardlib's own FSDP program, on NCCL's rings (``planner.cost.links``),
those rows come out 1.4-2.8x faster than published; llm-foundry's PyTorch FSDP runs of 2023
on the same links are predicted within 5%. The difference is the program, so, as for
Megatron-LM's runs (``planner.calibrate.megatron``), the published runs are costed with their
own. DeepSpeed's stage 3 of early-mid 2021 (v0.3.13-0.4, before its PR 1188 of 2021-06-25;
read in the ZeRO-Infinity staging branch's ``deepspeed/runtime/zero/partition_parameters.py``
and ``stage3.py``, and its issues 1069, 1173, 1174):

* **one all-gather per parameter tensor**, over the whole data-parallel group (every GPU
  here), in fp16, with ``torch.cuda.synchronize()`` before each and the module's forward
  waiting for its gathers: not overlapped. Tensors under ``stage3_param_persistence_threshold``
  (1e5 elements: norms and biases) stay whole; a GPT layer gathers its four matrices.
* **on every run of a module**: its forward hook gathers and its post-forward hook releases,
  so under activation checkpointing a layer is gathered three times a step (forward, the
  recomputed forward, backward).
* **the list form of ``torch.distributed.all_gather``**: NCCL gathers into one flat buffer and
  PyTorch copies each rank's part out, one eager copy per rank (``world x (EAGER_OP +
  kernel_launch)`` per gather: seconds that grow with the GPU count).
* **gradients all-reduced in fp16** per ``reduce_bucket_size`` bucket (5e8 elements; the
  default ``contiguous_gradients=false`` path all-reduces instead of reduce-scattering), on
  the compute stream (``overlap_comm`` off by default then): not overlapped.
"""

from __future__ import annotations

import math

from shardlib.planner.cost import total as cost
from shardlib.planner.cost.terms.base import Comm, Contribution, Step

GATHERED_PER_LAYER = 4
"""A GPT layer's tensors over the persistence threshold: q/k/v, the output projection, the
MLP's two matrices."""
PASSES = 3
"""Gathers per layer and step under activation checkpointing: forward, recompute, backward."""
BUCKET = 5e8
"""``reduce_bucket_size``: gradient elements per all-reduce."""
GRAD_BYTES = 2
"""fp16 gradients."""
EAGER_OP = 10e-6
"""Seconds of host work per PyTorch eager op (dispatch in C++, the caching allocator),
before its kernel launches: the copy-out loop issues one op per rank. An estimate (PyTorch's
per-op overhead is commonly quoted at ~10 us), not fitted."""


def zero3_program() -> cost.Program:
    """DeepSpeed 2021's ZeRO-3 as a ``cost.Program``: shardlib's terms (the same model's
    FLOPs, state and activations) with the FSDP traffic replaced by DeepSpeed's."""
    return cost.Program(_terms)


def _terms(step: Step) -> list[Contribution]:
    return [*cost.replacing(step, {"fsdp"}), _zero3(step)]


def _zero3(step: Step) -> Contribution:
    view, w = step.view, step.workload
    n = view["fsdp"]
    if n <= 1:
        return Contribution()
    axes = ("fsdp",)
    layer = step.layer_elements * n  # one whole layer (the table holds the shards)
    gathers = PASSES * step.layers_per_device * view.microbatches
    grads = step.held_elements * n
    comms = (
        Comm("fsdp", "weights", "all-gather", axes, n, layer * w.compute_bytes, gathers, False,
             GATHERED_PER_LAYER),
        Comm("fsdp", "grads", "all-reduce", axes, n, grads * GRAD_BYTES, view.microbatches,
             False, math.ceil(grads / BUCKET)),
    )  # fmt: skip
    copies = gathers * GATHERED_PER_LAYER * n  # one copy-out kernel per rank and gather
    launch = step.cluster.kernel_launch if step.cluster is not None else 0.0
    return Contribution(comms=comms, seconds=copies * (EAGER_OP + launch))
