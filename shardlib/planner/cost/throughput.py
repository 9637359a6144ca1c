"""The throughput model: a step's time from its matmul shapes, its links and what overlaps.

One flat "75% of peak" made every plan compute equally fast, so plans tied and memory broke
the tie. Here the rate depends on the plan:

* **Compute.** One block's forward on one micro-batch, on one device, is a list of matmuls
  (q/k/v, scores, values, output projection, MLP in and out) plus the output head, each
  with its (M, K, N) after the tensor, sequence and batch splits. Each runs at the roofline
  rate ``min(peak x matmul_efficiency, intensity x HBM bandwidth)``: a matmul whose
  FLOPs per byte moved (bf16 operands and result) fall below the GPU's ops:byte ratio is
  memory-bound; and its output tiles run in waves over the streaming multiprocessors, the
  last one partly idle (NVIDIA, "Matrix Multiplication Background User's Guide", sections
  "Math and memory bounds" and "Wave quantization", https://docs.nvidia.com/deeplearning/
  performance/dl-performance-matrix-multiplication/index.html): half a wave lost on
  average, so small per-device products (high tensor degree, small micro-batch) are
  slower. A compute-bound GEMM's tiles also wait on ``Cluster.tile_transfers`` tile-sized
  HBM transfers each (the C store, the pipeline's first loads) at the SM's share of the
  bandwidth: a short inner dimension loses more. ``matmul_efficiency``, the fraction of peak
  a large matmul reaches, and ``tile_transfers`` are cluster fields fitted on published runs
  (docs/throughput_calibration.md). A fused attention kernel is the program's
  (``AttentionKernel``). Elementwise work (norms,
  residual adds, rotary, SwiGLU's product, the softmax over the scores that dense attention
  writes out) streams its bytes through HBM. The backward pass runs the same shapes twice
  (input and weight gradients) and its elementwise work about twice, so one rate (FLOPs
  over seconds of that forward) times every FLOP the terms count (backward, recompute, the
  pipeline's bubble).
* **Communication** per collective as NCCL runs it (``planner.cost.links``): the bytes
  that stay in a host on NVLink, those that cross on the host's NICs together, at the
  achieved bus bandwidths the cluster preset cites (nccl-tests), plus ring or tree hop
  latencies.
* **Overlap.** Each term says whether its collectives sit on the critical path of a plan
  (``Term.exposed``: tensor-parallel and expert all-reduces, the pipeline's hand-overs; a
  pipeline's data-parallel reduction, after its flush, as Megatron-LM's) and, if not,
  what compute they hide behind (``Term.window``): gradient reductions behind the backward
  pass (without stages: a micro-batch's reduction behind its own backward), exposed only
  beyond it; ring-attention passes behind the attention blocks only (Liu et al. 2023: a
  pass is free while a block's compute outlasts its transfer); FSDP's behind ``OVERLAP`` of
  their own phase's compute (``Comm.window``: a layer's forward gather behind the forward,
  its backward gather and gradient reduction behind the backward; prefetch is partial: an
  assumption, not fitted; llm-foundry's FSDP runs across hosts,
  ``benchmarks/fsdp_validation.py``, read within 5% with it); the rest behind ``OVERLAP``
  of all compute.
* **Beyond the roofline**: the loss head's fp32 softmax passes over the logits
  (``BlockTraffic.logits``), the saved activations' HBM round trip (``saved_seconds``) and
  the kernels' launch gaps (``launch_seconds``), measured against the H200 runs of
  docs/gpu.md and llm-foundry's FSDP runs (``benchmarks/fsdp_validation.py``).
* **The optimizer update** (``update_seconds``): a pass over the held state at HBM
  bandwidth, after the reduction, exposed.

Which program runs is ``cost.Program``'s: the elementwise traffic (``BlockTraffic``) and
the terms. The planner costs shardlib's; the calibration costs the published runs' own
(``planner.calibrate.megatron``) on this same model.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardlib.planner.cost import links
from shardlib.planner.cost.kernels import (
    CUDNN_ATTENTION,
    LLAMA_TRAFFIC,
    AttentionKernel,
    BlockTraffic,
    Shape,
    block_matmuls,
    elementwise_bytes,
    head_matmul,
)
from shardlib.planner.cost.terms import TERMS
from shardlib.planner.cost.terms.base import ADAM_BYTES, MASTER_BYTES, Comm, Step
from shardlib.planner.cost.terms.model import layer_activation_bytes
from shardlib.planner.inputs.cluster import Cluster

if TYPE_CHECKING:
    from shardlib.planner.candidate import PlanView

OVERLAP = 0.8
"""Fraction of a window's compute time that FSDP prefetches hide behind (an assumption: the
calibration runs use none)."""
BACKWARD_SHARE = 2 / 3
"""The backward pass's share of compute (two matmuls per forward one): the window a
data-parallel reduction overlaps."""
EXPOSED = {term.name: term.exposed for term in TERMS if term.exposed is not None}
"""Per strategy (``Comm.strategy``): whether its collectives sit on the critical path of a
plan whatever the compute (``Term.exposed``)."""
WINDOW = {term.name: term.window for term in TERMS}
"""Per strategy: the compute its overlappable collectives hide behind (``Term.window``)."""


@dataclass(frozen=True)
class Rate:
    """The forward of one micro-batch on one device (its blocks and the head), timed."""

    flops: float
    seconds: dict[str, float]
    """Seconds by part: each matmul (all blocks), ``head``, ``elementwise``."""
    peak: float
    """The device's peak FLOP/s."""

    @property
    def flops_per_s(self) -> float:
        return self.flops / sum(self.seconds.values())

    @property
    def efficiency(self) -> float:
        """Fraction of peak this plan's shapes reach."""
        return self.flops_per_s / self.peak


def compute_rate(
    step: Step,
    cluster: Cluster,
    traffic: BlockTraffic = LLAMA_TRAFFIC,
    attention: AttentionKernel = CUDNN_ATTENTION,
) -> Rate:
    """The rate one device computes this plan's forward (and backward) at."""
    return shape_rate(Shape.of(step, traffic, attention), cluster)


def update_seconds(step: Step, cluster: Cluster) -> float:
    """The optimizer update: an elementwise pass over the state a device holds, after the
    gradients are reduced and before the next forward (nothing to overlap it with).

    Adam reads and writes the fp32 master weights and its m and v (sharded by ZeRO-1 and
    up), reads the fp32 gradients and writes the compute-dtype copy the next forward reads:
    about 30 bytes per parameter held, at HBM bandwidth (the same streaming bound as the
    elementwise work). Optimizer state offloaded to the host is updated there (``host_s``)."""
    view = step.view
    held = step.held_elements
    optimizer = 0.0 if view.offload else held * ADAM_BYTES / (view["data"] if view.zero >= 1 else 1)
    passes = held * (3 * MASTER_BYTES + step.workload.compute_bytes) + 2 * optimizer
    return passes / cluster.hbm_bw


KERNELS_PER_LAYER = 30
"""GPU kernels one block runs per micro-batch, forward and backward, as XLA fuses
shardlib's block: about ten forward (two norm fusions, the q/k/v, output and two MLP
products, rotary, attention, SwiGLU's product, the residual adds) and twice that backward."""


def saved_seconds(step: Step, cluster: Cluster) -> float:
    """HBM time of the activations the forward saves for the backward: written once and
    read once, beyond the elementwise passes ``BlockTraffic`` counts. Recomputed values are
    consumed inside the backward's fusions; saved ones make the round trip. The H200 runs of
    docs/gpu.md show it: without it every ``remat=none`` step was predicted 1.20-1.38x too
    fast while ``remat=full`` (which saves one input per layer) read 1.00-1.04."""
    view = step.view
    per_layer = layer_activation_bytes(step, step.micro_batch)
    return 2 * per_layer * step.layers_per_device * view.microbatches / cluster.hbm_bw


def launch_seconds(step: Step, cluster: Cluster) -> float:
    """Per-kernel launch gaps (``Cluster.kernel_launch``) of the blocks' kernels, per step:
    what keeps small models and micro-batches below the roofline."""
    kernels = KERNELS_PER_LAYER * step.layers_per_device * step.view.microbatches
    return kernels * cluster.kernel_launch


@functools.lru_cache(maxsize=16384)
def shape_rate(shape: Shape, cluster: Cluster) -> Rate:
    size, layers = shape.workload.compute_bytes, shape.layers
    seconds: dict[str, float] = {}
    flops = 0.0
    for mm in block_matmuls(shape):
        seconds[mm.name] = layers * mm.seconds(cluster, size)
        flops += layers * mm.flops
        if mm.name == "scores" and shape.fused and shape.attention.exponentials:
            # one exponential per score the causal kernel computes: half of [s, s] per head
            seconds["softmax"] = layers * mm.m * mm.n * mm.batch / 2 / cluster.sfu_rate
    head = head_matmul(shape)
    seconds["head"] = head.seconds(cluster, size)
    flops += head.flops
    w = shape.workload
    seconds["loss"] = shape.tokens * w.vocab / shape.tensor * shape.traffic.logits * size
    seconds["loss"] /= cluster.hbm_bw
    seconds["elementwise"] = layers * elementwise_bytes(shape) / cluster.hbm_bw
    return Rate(flops, seconds, cluster.peak_flops)


def collective_seconds(comm: Comm, cluster: Cluster, axes: tuple) -> float:
    """Wire bytes at the achieved bandwidth of the links they use, plus hop latencies
    (``planner.cost.links``: NCCL's rings over NVLink and the hosts' NICs)."""
    if comm.group <= 1 or comm.count == 0:
        return 0.0
    ops = comm.count * comm.ops
    one = links.seconds(
        cluster, comm.kind, axes, comm.axes, comm.wire_bytes / ops, comm.buffer_bytes / comm.ops
    )
    return one * ops


def exposed_strategies(view: PlanView) -> frozenset[str]:
    """The strategies whose collectives sit on the critical path of this plan whatever the
    compute (``Term.exposed``)."""
    return frozenset(name for name, exposed in EXPOSED.items() if exposed(view))


def is_exposed(comm: Comm, exposed: frozenset[str]) -> bool:
    """On the critical path whatever the compute: a collective of the ``exposed``
    strategies (``exposed_strategies`` of the plan), or one that cannot overlap."""
    return comm.strategy in exposed or not comm.overlap


def exposed_seconds(
    comms: Iterable[Comm],
    cluster: Cluster,
    axes: tuple,
    windows: dict[str, float],
    view: PlanView,
) -> tuple[float, float]:
    """(exposed seconds, all collective seconds) of a step.

    ``windows``: the compute seconds each kind of overlappable collective hides behind
    (``overlap_windows``; a term's ``window``, ``default`` where the dict has none of its
    kind). What spills over its window is exposed; they also share the links and the
    step, so together they expose at least what exceeds the longest window.
    """
    critical = 0.0
    hidden: dict[str, float] = {}
    exposed = exposed_strategies(view)
    for comm in comms:
        seconds = collective_seconds(comm, cluster, axes)
        if is_exposed(comm, exposed):
            critical += seconds
        else:
            key = comm.window or WINDOW.get(comm.strategy, "default")
            key = key if key in windows else "default"
            hidden[key] = hidden.get(key, 0.0) + seconds
    spill = sum(max(0.0, s - windows[k]) for k, s in hidden.items())
    spill = max(spill, sum(hidden.values()) - max(windows.values(), default=0.0))
    return critical + spill, critical + sum(hidden.values())


def overlap_windows(rate: Rate, compute_s: float, recompute: bool = False) -> dict[str, float]:
    """The compute seconds each kind of overlappable collective hides behind (``Term.window``,
    ``Comm.window``): ``backward`` the backward pass, ``attention`` the attention blocks,
    ``default`` ``OVERLAP`` of all compute; ``forward`` and ``backward prefetch``: ``OVERLAP``
    of one phase's compute (FSDP: a layer's forward gather hides behind the forward, its
    backward gather and its gradient reduction behind the backward, which holds the
    recomputed forward too under ``recompute``)."""
    total = sum(rate.seconds.values())
    parts = ("scores", "values", "softmax")
    attention = sum(rate.seconds.get(k, 0.0) for k in parts) / total
    forward = (1 / 4 if recompute else 1 - BACKWARD_SHARE) * compute_s
    return {
        "backward": BACKWARD_SHARE * compute_s,
        "attention": attention * compute_s,
        "default": OVERLAP * compute_s,
        "forward": OVERLAP * forward,
        "backward prefetch": OVERLAP * (compute_s - forward),
    }
