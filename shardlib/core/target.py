"""What a parallel plan is checked against: the model's facts, the batch and the sequence.

Strategies refuse what they cannot run before anything compiles. Their checks need a few
facts of the model (the size of each logical dim, the number of stacked blocks, the
intermediates it tags for remat) and of the step (micro-batch, sequence, precision). These
are read from the model's abstract parameters (``nnx.eval_shape``), never from a copy, so
the same checks serve the trainer, the planner and a user's own model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Target:
    """The model and step a ``ParallelPlan`` is applied to."""

    dims: Mapping[str, int] = field(default_factory=dict)
    """Size of every logical dim the parameters name (``{"embed": 4096, "heads": 32}``)."""
    layers: int = 1
    """Stacked blocks (the ``layers`` dim of the model's ``blocks``)."""
    checkpoint_names: tuple[str, ...] = ()
    """Intermediates the model tags with ``checkpoint_name`` (for ``remat=names:...``)."""
    batch: int = 1
    """Sequences per optimizer step (all micro-batches together)."""
    microbatches: int = 1
    """Gradient-accumulation micro-batches the batch is split into."""
    seq: int = 1
    """Tokens per sequence."""
    precision: str = "fp32"
    """Compute precision (fp32, bf16, fp16)."""
    block_stats: bool = False
    """The blocks return per-layer statistics besides the residual (an MoE router's)."""

    @property
    def micro_batch(self) -> int:
        """Sequences in one gradient-accumulation micro-batch."""
        return self.batch // self.microbatches

    @property
    def experts(self) -> int:
        """Experts per MoE layer (0: a dense model), from the ``expert`` dim."""
        return self.dims.get("expert", 0)

    @classmethod
    def from_params(cls, params, **step) -> Target:
        """Facts from ``(path, shape, names)`` entries (``core.model.Inventory.params``)."""
        dims: dict[str, int] = {}
        layers = 1
        for _, shape, names in params:
            for size, name in zip(shape, names or (), strict=False):
                if name == "layers":
                    layers = size
                elif name is not None:
                    dims.setdefault(name, size)
        return cls(dims=dims, layers=layers, **step)
