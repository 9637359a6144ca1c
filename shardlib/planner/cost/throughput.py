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
  pass is free while a block's compute outlasts its transfer); the rest (FSDP gathers and
  reductions) behind ``OVERLAP`` of the compute (prefetch is partial: an assumption, not
  fitted; llm-foundry's FSDP runs across hosts, ``benchmarks/fsdp_validation.py``, read
  within 5% with it).
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
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shardlib.core.workload import Workload
from shardlib.planner.cost import links
from shardlib.planner.cost.terms import TERMS
from shardlib.planner.cost.terms.base import ADAM_BYTES, MASTER_BYTES, Comm, Step
from shardlib.planner.cost.terms.model import layer_activation_bytes
from shardlib.planner.inputs.cluster import Cluster

if TYPE_CHECKING:
    from shardlib.planner.candidate import PlanView

OVERLAP = 0.8
"""Fraction of compute time that FSDP prefetches hide behind (an assumption: the
calibration runs use none)."""
BACKWARD_SHARE = 2 / 3
"""The backward pass's share of compute (two matmuls per forward one): the window a
data-parallel reduction overlaps."""
TILE = 128
"""Output tile edge of a cuBLAS matmul (the guide's "Typical tile dimensions": 256x128 and
128x128; the smaller, which cuBLAS falls back to for small products)."""
FUSED_ATTENTION = 0.92
"""Fraction of the matmul ceiling a fused attention kernel's products reach, counted over
the planner's attention FLOPs (which include the half the causal mask skips). Measured:
cuDNN's kernel on an H200 reached 0.61-1.23 of it over Llama 1B's and 7B's heads at seq
2048-8192, median 0.92 (``benchmarks/gpu_attention.py``, docs/gpu.md)."""


@dataclass(frozen=True)
class AttentionKernel:
    """How a program's fused attention kernel computes (``Shape.fused``): its two products at
    a fraction of the matmul ceiling, and, for a kernel described rather than measured whole,
    the softmax's exponentials on the special-function units.

    The cuDNN kernel shardlib runs is measured whole (``FUSED_ATTENTION``: its exponentials are
    inside that fraction). A kernel that was not measured here is described by what it issues:
    its products at ``ceiling`` of the tensor cores' rate for the instructions it uses, and one
    exponential per score it computes, forward (the causal half of the planner's s x s; the
    backward recomputes them, in the FLOP multiple the rate is applied to). The exponentials
    are why a head dim of 64 runs attention at a lower FLOP rate than 128 (half the products
    per exponential), and why Hopper, whose tensor cores grew 3.2x over Ampere's and its
    special-function units 1.6x (16 per clock per SM on both), gives such a kernel less of its
    peak: 989 TFLOP/s of matmul against 3.9 T exponentials/s (Shah et al. 2024,
    FlashAttention-3, section 3)."""

    ceiling: float = FUSED_ATTENTION
    """Fraction of the matmul ceiling the products reach, over the planner's attention FLOPs."""
    legacy_mma: bool = False
    """Issued as Ampere's ``mma.sync``: on Hopper ``Cluster.mma_sync_fraction`` of the peak."""
    exponentials: bool = False
    """Time the exponentials apart, at ``Cluster.sfu_rate`` (False: inside ``ceiling``)."""


CUDNN_ATTENTION = AttentionKernel()
"""shardlib's fused kernel (``attention_impl=cudnn``), measured whole on an H200."""
EXPOSED = {term.name: term.exposed for term in TERMS if term.exposed is not None}
"""Per strategy (``Comm.strategy``): whether its collectives sit on the critical path of a
plan whatever the compute (``Term.exposed``)."""
WINDOW = {term.name: term.window for term in TERMS}
"""Per strategy: the compute its overlappable collectives hide behind (``Term.window``)."""


@dataclass(frozen=True)
class BlockTraffic:
    """HBM traffic per token of one block's forward elementwise work, read + written, in
    units of a width of the compute dtype: what a program's fused elementwise kernels stream.

    The matmuls' own operand and result bytes are the roofline's (``Matmul.bytes``); these
    are the passes between them. Different programs of the same model differ here: a GPT
    block with dropout streams its attention probabilities twice more than shardlib's Llama
    block (``planner.calibrate.megatron``)."""

    embed: float = 10
    """Over the embedding width. Llama (models/llama/model.py): two RMSNorms (read, write), two
    residual adds (read two, write one)."""
    rotary: float = 2
    """Over the q and k widths: rotary (read, write)."""
    mlp: float = 3
    """Over the MLP width: SwiGLU's silu(gate) * up (read two, write one)."""
    scores: float = 6
    """Over the attention scores (heads x keys per token) that dense attention writes to HBM:
    scale, mask and softmax. Measured, not counted: XLA's GPU program of the dense kernel
    streamed 5.3-6.8 widths per score element beyond its two products (median 5.9) on an
    H200 (``benchmarks/gpu_attention.py``: fwd + bwd of Llama 1B's and 7B's heads at seq
    2048-8192, docs/gpu.md); one fused read + write would be 2."""
    logits: float = 2
    """Over the vocabulary (split by tensor), the loss head's: the logits in fp32 read once by
    the softmax fusion (4 bytes: 2 widths of bf16), in forward units; with the backward's
    read and its gradient's write the step streams about three fp32 passes per logit. A
    small model's share: at 125M (vocab 50,368, h 768) ~10% of a step."""


LLAMA_TRAFFIC = BlockTraffic()
"""shardlib's own block (models/llama/model.py), as XLA fuses it."""


@dataclass(frozen=True)
class Matmul:
    """One (batched) matmul of a block's forward on one device: [M, K] x [K, N]."""

    name: str
    m: float
    k: float
    n: float
    batch: float = 1.0
    """Independent products (attention: sequences x heads on the device)."""
    moved: float | None = None
    """Elements read and written per product where an operand or the result stays on chip
    (a fused attention kernel: the score matrix never reaches HBM); None: all three move."""
    ceiling: float = 1.0
    """Fraction of the cluster's matmul ceiling this kernel reaches (``FUSED_ATTENTION``)."""
    legacy_mma: bool = False
    """Issued as ``mma.sync``: at ``Cluster.mma_sync_fraction`` of the peak (Hopper: 2/3)."""

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.k * self.n * self.batch

    def bytes(self, itemsize: int) -> float:
        """Operands read and result written once (the roofline's minimum traffic)."""
        moved = self.m * self.k + self.k * self.n + self.m * self.n
        return itemsize * (moved if self.moved is None else self.moved) * self.batch

    def waves(self, cluster: Cluster) -> float:
        """Output tiles per pass of all the streaming multiprocessors."""
        tiles = self.batch * math.ceil(self.m / TILE) * math.ceil(self.n / TILE)
        return tiles / cluster.sms

    def seconds(self, cluster: Cluster, itemsize: int) -> float:
        """Roofline time (compute-bound at the ceiling, or memory-bound below the ridge),
        plus the last wave's idle SMs: half a wave on average. A compute-bound GEMM's tiles
        (not a fused kernel's) each also wait on ``Cluster.tile_transfers`` tile-sized HBM
        transfers at the SM's share of the bandwidth; a memory-bound one is all transfers,
        at the roofline's streaming time."""
        ceiling = self.ceiling * (cluster.mma_sync_fraction if self.legacy_mma else 1.0)
        math_s = self.flops / (cluster.peak_flops * cluster.matmul_efficiency * ceiling)
        memory_s = self.bytes(itemsize) / cluster.hbm_bw
        if cluster.sms:
            waves = self.waves(cluster)
            math_s *= (waves + 0.5) / waves
            if self.moved is None and cluster.tile_transfers and math_s > memory_s:
                tile_s = cluster.tile_transfers * TILE * TILE * itemsize * cluster.sms
                math_s += (waves + 0.5) * tile_s / cluster.hbm_bw
        return max(math_s, memory_s)


@dataclass(frozen=True)
class Shape:
    """What one device's compute rate depends on (a cache key: plans share it)."""

    workload: Workload
    tensor: int
    seq_ways: int
    """Ways the axes that split the sequence split it (each device's queries: s/seq_ways)."""
    micro_batch: int
    """Sequences of one micro-batch on one device."""
    layers: int
    """Blocks on one device."""
    traffic: BlockTraffic = LLAMA_TRAFFIC
    """What the program's elementwise kernels stream per token."""
    fused: bool = False
    """Attention in one fused kernel (``attention_impl=cudnn``): no score matrix in HBM."""
    fp8_share: float = 0.0
    """Share of the block projections' FLOPs that run as FP8 GEMMs (``fp8_share``)."""
    attention: AttentionKernel = CUDNN_ATTENTION
    """The program's fused attention kernel, when ``fused``."""

    @classmethod
    def of(
        cls,
        step: Step,
        traffic: BlockTraffic = LLAMA_TRAFFIC,
        attention: AttentionKernel = CUDNN_ATTENTION,
    ) -> Shape:
        view = step.view
        return cls(
            step.workload, view["tensor"], view.ways("seq"), step.micro_batch,
            step.layers_per_device, traffic, view.fused_attention,
            fp8_share(step.workload.precision, view.plan.remat.policy), attention,
        )  # fmt: skip

    @property
    def tokens(self) -> int:
        """Rows of the projections: the micro-batch's local tokens."""
        return self.micro_batch * self.workload.seq // self.seq_ways


FP8_RATE = 2.0
"""FP8 tensor-core peak over the bf16 one (H100/H200 data sheet: 1,979 against 989 TFLOP/s
dense), at the same achieved fraction."""


def fp8_share(precision: str, remat: str) -> float:
    """Share of the projections' FLOPs (forward + two backward products) that XLA compiles to
    FP8 GEMMs under ``precision=fp8``. Measured on one H200, jax 0.11.2, with Triton GEMMs
    off (``benchmarks/gpu_fp8.py``, docs/gpu.md): under ``remat=full`` every projection,
    forward and backward, was a cuBLASLt FP8 GEMM (15 of 15 products); otherwise only the
    forward ones (4 of 15), since the backward reads the dequantized operands the forward
    saved, not the quantize-dequantize pattern the rewrite matches."""
    if precision != "fp8":
        return 0.0
    return 1.0 if remat == "full" else 1 / 3


def block_matmuls(shape: Shape) -> tuple[Matmul, ...]:
    """One block's forward matmuls on one micro-batch, on one device (after every split)."""
    w, t, b = shape.workload, shape.tensor, shape.micro_batch
    s_q = w.seq // shape.seq_ways  # local queries
    d, heads = w.head_dim, w.heads / t
    qkv = (w.heads + 2 * w.kv_heads) * d / t
    mlp = (w.mlp or w.expert_mlp) / t
    matrices = w.mlp_matrices if w.mlp else w.expert_mlp_matrices  # 3 SwiGLU, 2 GELU
    # attention: per sequence and local head, [s/c, d] x [d, s]; split over c devices it
    # runs in c blocks of s/c keys each (ring attention: the same FLOPs, narrower products)
    keys, passes = (s_q, shape.seq_ways) if shape.seq_ways > 1 else (w.seq, 1)
    # a fused kernel reads q and k (scores), v, and writes the output (values): (s + s)·d
    # elements each, never the [s, s] scores
    moved = (s_q + keys) * d if shape.fused else None
    kernel = shape.attention
    fused = (kernel.ceiling, kernel.legacy_mma) if shape.fused else (1.0, False)
    attn = b * heads * passes
    # projections: a share of their products runs at the FP8 rate (none without fp8)
    proj = 1 / (1 - shape.fp8_share * (1 - 1 / FP8_RATE))
    return (
        Matmul("qkv", shape.tokens, w.embed, qkv, ceiling=proj),  # [b·s, h] x [h, (a+2kv)·d/t]
        Matmul("scores", s_q, d, keys, attn, moved, *fused),  # [s, d] x [d, s] per head
        Matmul("values", s_q, keys, d, attn, moved, *fused),  # [s, s] x [s, d] per head
        Matmul("out", shape.tokens, heads * d, w.embed, ceiling=proj),  # [b·s, a·d/t] x [a·d/t, h]
        # SwiGLU's gate and up [h, 2f/t]; a GELU MLP's one [h, f/t]
        Matmul("mlp_in", shape.tokens, w.embed, (matrices - 1) * mlp, ceiling=proj),
        Matmul("mlp_out", shape.tokens, mlp, w.embed, ceiling=proj),  # [b·s, f/t] x [f/t, h]
    )


def head_matmul(shape: Shape) -> Matmul:
    """The output projection of one micro-batch: [b·s, h] x [h, V/t]."""
    w = shape.workload
    return Matmul("head", shape.tokens, w.embed, w.vocab / shape.tensor)


def elementwise_bytes(shape: Shape) -> float:
    """HBM bytes of one block's forward elementwise work on one micro-batch, one device."""
    w, t, k = shape.workload, shape.tensor, shape.traffic
    keys = w.seq  # every query meets every key: in one pass, or in c ring passes of s/c
    widths = (
        k.embed * w.embed
        + k.rotary * 2 * w.heads * w.head_dim / t  # q and k get rotary
        + k.mlp * (w.mlp or w.expert_mlp) / t
        + (0.0 if shape.fused else k.scores * w.heads / t * keys)
    )
    return shape.tokens * widths * w.compute_bytes


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
    bw, latency = links.priced(cluster, comm.kind, axes, comm.axes)
    return comm.wire_bytes / bw + latency * comm.count * comm.ops


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
            key = WINDOW.get(comm.strategy, "default")
            key = key if key in windows else "default"
            hidden[key] = hidden.get(key, 0.0) + seconds
    spill = sum(max(0.0, s - windows[k]) for k, s in hidden.items())
    spill = max(spill, sum(hidden.values()) - max(windows.values(), default=0.0))
    return critical + spill, critical + sum(hidden.values())


def overlap_windows(rate: Rate, compute_s: float) -> dict[str, float]:
    """The compute seconds each kind of overlappable collective hides behind (``Term.window``):
    ``backward`` the backward pass, ``attention`` the attention blocks, ``default``
    ``OVERLAP`` of all compute."""
    total = sum(rate.seconds.values())
    parts = ("scores", "values", "softmax")
    attention = sum(rate.seconds.get(k, 0.0) for k in parts) / total
    return {
        "backward": BACKWARD_SHARE * compute_s,
        "attention": attention * compute_s,
        "default": OVERLAP * compute_s,
    }
