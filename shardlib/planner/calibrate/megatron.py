"""Megatron-LM's program for a layout: what the published GPT runs compute and move.

The throughput model is calibrated on published Megatron-LM runs
(docs/throughput_calibration.md). For the same layout (t, p, d, micro-batches) shardlib's
program and Megatron's differ, and costing shardlib's would fit those differences into the
hardware constants (the deep-pipeline runs moved 10-25 s per step more in shardlib's SPMD
pipeline than Megatron's point-to-point sends). This module states Megatron's program in
the planner's terms, so that ``cost.estimate(..., program=megatron_program(...))`` costs it
on the same hardware model (compute rate, links, overlap) as the planner's own plans:

* **the GPT block** (Narayanan et al. 2021; Korthikanti et al. 2022, section 4.1): LayerNorm
  instead of RMSNorm, no rotary, bias-GeLU over 4h (the same bytes as SwiGLU over 8h/3),
  and dropout (Megatron-LM's default 0.1 on attention probabilities and on both residual
  branches): a bias-dropout-add streams x, the residual, the output and a 1-byte mask; the
  attention dropout reads and writes the probabilities and a mask once more after the
  fused softmax (Korthikanti et al.'s activation count, 5as/h per token: softmax output,
  dropout mask, dropout output);
* **tensor parallelism**: 2 all-reduces of b·s·h per layer forward and 2 backward (Shoeybi
  et al. 2019); full recompute re-runs the layer's forward, both all-reduces again;
  sequence parallelism turns each into an all-gather and a reduce-scatter of the same
  volume (Korthikanti et al. 2022, section 4.2.2);
* **selective recompute** re-runs the attention core (q·kᵀ, softmax, dropout, ·v): all of
  the attention FLOPs again (shardlib's selective policy recomputes q·kᵀ only);
* **pipeline**: non-interleaved 1F1B; per micro-batch and stage boundary one activation
  forward and one gradient backward, point-to-point and on the critical path: 2(m+p-1)
  hand-overs per step on the slowest stage's timeline. With the scatter/gather
  optimisation (Narayanan et al. 2021, section 4.1) each of the t GPUs sends b·s·h/t over
  its own InfiniBand link and the receivers all-gather over NVLink; without it (DeepSpeed's
  pipeline engine, MT-NLG) each sends all of b·s·h. The bubble is (p-1)/m of the ideal
  step, the recompute included (a bubble slot is a whole micro-batch's fwd, recompute and
  bwd);
* **data parallelism**: one all-reduce of the device's gradients per step, after the
  backward pass (Megatron-LM's local DDP, ``--DDP-impl local``: not overlapped) in the
  gradient dtype: fp16 for the 2021 fp16 runs, fp32 for bf16 (Megatron-LM requires fp32
  gradient accumulation and all-reduce with bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardlib.core.mesh import Axis
from shardlib.planner.cost import total as cost
from shardlib.planner.cost.kernels import BlockTraffic
from shardlib.planner.cost.terms import pipeline, remat, tensor
from shardlib.planner.cost.terms.base import Comm, Contribution, Step

GPT_TRAFFIC = BlockTraffic(embed=11, rotary=0, mlp=3, scores=4.5)
"""The GPT block with dropout, per token of one block's forward, in widths of the compute
dtype: two LayerNorms (read, write: 4) and two bias-dropout-adds (read two, write one, a
1-byte mask: 7) over h; bias-GeLU over 4h (read, write), 3 widths of shardlib's 8h/3 MLP
width; fused scale-mask-softmax (read, write) and dropout (read, write, mask) over the
scores: 4.5."""


@dataclass(frozen=True)
class Megatron:
    """Which Megatron-LM program a published run used."""

    sequence_parallel: bool = False
    """Korthikanti et al. 2022: the tensor all-reduces as all-gather + reduce-scatter."""
    scatter_gather: bool = True
    """Pipeline sends split over the tensor group (Megatron-LM); False: DeepSpeed's."""
    grad_bytes: int = 2
    """The data-parallel all-reduce's dtype: 2 (fp16, 2021), 4 (fp32 with bf16)."""


def megatron_program(version: Megatron) -> cost.Program:
    """The program of ``version`` as a ``cost.Program``."""
    return cost.Program(lambda step: _terms(step, version), GPT_TRAFFIC)


def _terms(step: Step, version: Megatron) -> list[Contribution]:
    """shardlib's terms with the tensor, pipeline, data and recompute parts replaced by
    Megatron-LM's (the model's FLOPs, state and activations are the same model's)."""
    # each replaced term's FLOPs (the pipeline's bubble) and memory stay
    parts = cost.replacing(step, {"tensor", "pipeline", "dp"})
    ours = (_tensor(step, version), _pipeline(step, version), _data(step, version))
    return [*parts, *ours, Contribution(flops=_extra_flops(step))]


def _bsh(step: Step) -> float:
    return step.micro_batch * step.local_seq * step.workload.embed * step.workload.compute_bytes


def _tensor(step: Step, version: Megatron) -> Contribution:
    view = step.view
    if view["tensor"] <= 1:
        return Contribution()
    per_layer = 4 + (2 if view.remat == "full" else 0)
    count = per_layer * step.layers_per_device * view.microbatches
    axes, t, bsh = (str(Axis.TENSOR),), view["tensor"], _bsh(step)
    kinds = ("all-gather", "reduce-scatter") if version.sequence_parallel else ("all-reduce",)
    comms = [Comm("tensor", "activations", kind, axes, t, bsh, count, False) for kind in kinds]
    # the vocab-parallel embedding and cross-entropy: as shardlib's (``terms.tensor``)
    comms += [c for c in tensor.tensor(step).comms if c.what != "activations"]
    return Contribution(comms=tuple(comms))


def _pipeline(step: Step, version: Megatron) -> Contribution:
    view = step.view
    if view["stage"] <= 1:
        return Contribution()
    handovers = 2 * (view.microbatches + view["stage"] - 1)
    bsh, stage, tens = _bsh(step), (str(Axis.STAGE),), (str(Axis.TENSOR),)
    split = view["tensor"] if version.scatter_gather else 1
    comms = [Comm("pipeline", "activations", "collective-permute", stage, view["stage"],
                  bsh / split, handovers, False)]  # fmt: skip
    if split > 1:
        comms.append(Comm("pipeline", "activations", "all-gather", tens, split, bsh, handovers,
                          False))  # fmt: skip
    return Contribution(comms=tuple(comms))


def _data(step: Step, version: Megatron) -> Contribution:
    view = step.view
    if view["data"] <= 1:
        return Contribution()
    grads = step.held_elements * version.grad_bytes
    axes = (str(Axis.DATA),)
    return Contribution(
        comms=(Comm("dp", "grads", "all-reduce", axes, view["data"], grads, 1, False),)
    )


def _extra_flops(step: Step) -> float:
    """FLOPs Megatron runs beyond shardlib's terms for the same layout: the rest of the
    attention core under selective recompute (shardlib recomputes q·kᵀ only), and the
    recompute inside the 1F1B bubble (shardlib's gpipe bubble counts fwd and bwd)."""
    w, view = step.workload, step.view
    tokens = step.tokens
    layer = w.layer_matmul_flops_per_token / view["tensor"]
    attn = w.attention_flops_per_token(w.seq) / view["tensor"]
    extra = tokens * step.layers_per_device * attn / 2 if view.remat == "selective" else 0.0
    recompute = remat.recompute_flops(step, tokens, layer, attn) + extra
    frac = pipeline.bubble_fraction(view.schedule, view["stage"], view.microbatches, view.virtual)
    return extra + recompute * frac
