"""What one device computes per block, as the throughput model prices it: the matmuls of a
block's forward with their shapes after every split (``Matmul``, ``block_matmuls``), the
elementwise HBM traffic between them (``BlockTraffic``), and the fused attention kernel a
program runs (``AttentionKernel``). ``throughput`` turns these into a rate; the
calibrations describe the published programs' own kernels and traffic with the same types
(``planner.calibrate.megatron``, ``planner.calibrate.llmfoundry``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shardlib.core.workload import Workload
from shardlib.planner.cost.terms.base import Step
from shardlib.planner.inputs.cluster import Cluster

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
    qkv = w.local_qkv_width(t)  # K/V heads fewer than t: whole on every device
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
