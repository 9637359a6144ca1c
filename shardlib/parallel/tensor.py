"""Megatron 1D tensor parallelism, as rules.

Column-parallel layers split their output dim (QKV projections over ``heads``/``kv_heads``,
MLP-in over ``mlp``), row-parallel layers split their input dim (attention-out over
``heads``, MLP-out over ``mlp``), so each attention and MLP block needs one all-reduce of
the b*s*h residual in forward and one in backward. The embedding and the output projection
are vocab-parallel. The activations' head and mlp dims follow the weights so that XLA keeps
the intermediate results split instead of gathering them.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import Axis
from shardlib.core.rules import MEGATRON_DIMS, Rules
from shardlib.parallel.sequence import sequence_parallel
from shardlib.parallel.tensor2d import tensor_2d
from shardlib.parallel.tensor3d import tensor_3d


def tensor_parallel(*, axis: str = Axis.TENSOR) -> Rules:
    """Heads, kv-heads, MLP hidden and vocab dims over ``axis``, for weights and activations."""
    table = {name: (axis,) for name in MEGATRON_DIMS}
    return Rules(params=table, activations=table)


@dataclass(frozen=True)
class TensorParallel:
    """``[parallel.tensor]``: Megatron 1D over ``tensor``, 2D/3D when the mesh also has
    ``tensor2`` (and ``tensor3``), and Megatron sequence parallelism on top of 1D."""

    axes: ClassVar[dict[str, str]] = {
        Axis.TENSOR: "Megatron tensor parallel (the column axis of 2D/3D)",
        Axis.TENSOR2: "second axis of 2D/3D tensor parallel (rows)",
        Axis.TENSOR3: "third axis of 3D tensor parallel (depth)",
    }
    logical_names: ClassVar[dict[str, str]] = {}

    sequence_parallel: bool = False
    """Megatron-SP: split the residual stream's tokens over the tensor axis."""

    def rules(self, mesh_axes: Mapping[str, int]) -> list[Rules]:
        if Axis.TENSOR3 in mesh_axes:
            parts = [tensor_3d()]
        elif Axis.TENSOR2 in mesh_axes:
            parts = [tensor_2d()]
        elif Axis.TENSOR in mesh_axes:
            parts = [tensor_parallel(axis=Axis.TENSOR)]
        else:
            parts = []
        if self.sequence_parallel:
            self._check_sequence_parallel(mesh_axes)
            parts.append(sequence_parallel(axis=Axis.TENSOR))
        return parts

    @staticmethod
    def _check_sequence_parallel(mesh_axes: Mapping[str, int]) -> None:
        if Axis.TENSOR not in mesh_axes:
            raise ShardingError(
                "sequence_parallel=true splits the residual stream over the tensor axis, which "
                "the mesh lacks. Fix: add a tensor axis, or set sequence_parallel=false."
            )
        if Axis.TENSOR2 in mesh_axes or Axis.TENSOR3 in mesh_axes:
            raise ShardingError(
                "sequence_parallel=true with 2D/3D tensor parallelism: both split the residual "
                "stream over the tensor axis (tokens vs width). Fix: drop one of them."
            )
