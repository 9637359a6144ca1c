"""Data parallelism: split the batch, replicate everything else.

Gradients of replicated parameters are summed across the axis by XLA (one all-reduce per
step, 2(N-1)/N of the gradient bytes on the wire); no communication is written here. Two
settings compress it instead: ZeRO++'s (``zeropp.py``) and 1-bit Adam's momentum exchange
(``onebit_momentum``, ``train/onebit.py``); ``gradients.py`` picks the path they take.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import shardlib.parallel.zeropp as zeropp
from shardlib.core.errors import ShardingError
from shardlib.core.mesh import Axis
from shardlib.core.resolve import resolve_spec
from shardlib.core.rules import Rules
from shardlib.parallel.compression import check_bits
from shardlib.parallel.fsdp import fsdp


def data_parallel(*, axis: str = Axis.DATA) -> Rules:
    """Activations' ``batch`` dim over ``axis``; parameters stay replicated."""
    return Rules(activations={"batch": (axis,)})


@dataclass(frozen=True)
class DataParallel:
    """``[parallel.data]``: batch splitting over ``data`` and ``fsdp``, and the ZeRO stage."""

    axes: ClassVar[dict[str, str]] = {
        Axis.DATA: "batch split; parameters replicated (or ZeRO-1/2 state sharded)",
        Axis.FSDP: "batch split; parameters, gradients and optimizer state sharded (ZeRO-3)",
    }
    """The mesh axes this section switches on, and what each does."""
    logical_names: ClassVar[dict[str, str]] = {}
    """Logical names this strategy adds to the models' vocabulary (``rules.LOGICAL_NAMES``)."""

    zero: int = 0
    """ZeRO stage over the ``data`` axis: 0 replicated, 1 + optimizer state sharded,
    2 + gradients sharded, 3 + parameters sharded (FSDP). An ``fsdp`` axis is always ZeRO-3."""
    microbatches: int = 1
    """Gradient accumulation: the batch is split into this many sequential micro-batches
    (under a pipeline, each of them is split again into the pipeline's micro-batches)."""
    quantized_weights: bool = False
    """ZeRO++ qwZ: ZeRO-3's weight all-gathers carry int8 blocks (``parallel/zeropp.py``)."""
    hpz: bool = False
    """ZeRO++ hpZ: on a ``data x fsdp`` mesh (nodes x devices per node) the backward weight
    all-gather runs over ``fsdp`` alone, from a secondary partition kept after forward."""
    quantized_gradients: bool = False
    """ZeRO++ qgZ: the gradient reduce-scatter is an all-to-all of quantized blocks."""
    gradient_bits: int = 4
    """qgZ code width: 4 (the paper's) or 8."""
    onebit_momentum: bool = False
    """1-bit Adam (Tang et al. 2021; ``optimizer=onebit_adam`` sets it): gradients stay on
    their device and Adam's momentum crosses ``data`` as packed signs with error feedback,
    after ``optimizer.freeze_step`` full-precision steps: 1/32 of the all-reduce's bytes.
    Plain data parallelism (zero=0, no offload) with adam or adamw (``train/onebit.py``)."""
    vocab_parallel: bool = True
    """FSDP: split the embedding table and output projection on vocab and run the lookup and
    logits vocab-parallel, where that moves fewer bytes than gathering the tables (the plan
    decides per model and batch, ``ParallelPlan.for_workload``); false: never."""

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise ShardingError(f"zero={self.zero}. Fix: use a ZeRO stage 0, 1, 2 or 3.")
        if self.microbatches < 1:
            raise ShardingError(f"microbatches={self.microbatches}. Fix: use 1 or more.")
        check_bits(self.gradient_bits, "gradient_bits")

    @property
    def zeropp(self) -> bool:
        """Whether any ZeRO++ part is on (the gradient then comes from ``zeropp``)."""
        return self.quantized_weights or self.hpz or self.quantized_gradients

    def check(self, mesh_axes: Mapping[str, int], rules: Rules, workload) -> None:
        """The batch splits into micro-batches, and each one over the batch's mesh axes."""
        if self.zeropp:
            zeropp.check(self, mesh_axes, rules)
        batch = workload.global_batch
        if batch % self.microbatches:
            raise ShardingError(
                f"batch={batch} is not divisible by microbatches={self.microbatches}. "
                "Fix: choose a batch that is a multiple of microbatches."
            )
        mb = workload.micro_batch
        resolve_spec(
            f"batch (one micro-batch of {mb} sequences)",
            (mb, workload.seq + 1),
            ("batch", None),
            rules,
            mesh_axes,
            "activations",
        )
        resolve_spec(
            "activations [batch, seq, embed]",
            (mb, workload.seq, 1),
            ("batch", "seq", None),
            rules,
            mesh_axes,
            "activations",
        )

    def rules(self, mesh_axes: Mapping[str, int]) -> list[Rules]:
        """Data parallel over ``data``, FSDP over ``fsdp`` (outer axis first)."""
        parts = [data_parallel(axis=Axis.DATA)] if Axis.DATA in mesh_axes else []
        if Axis.FSDP in mesh_axes:
            parts.append(fsdp(axis=Axis.FSDP, vocab_parallel=self.vocab_parallel))
        return parts
