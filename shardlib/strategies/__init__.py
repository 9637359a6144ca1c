"""One small module per parallelism form; each returns rules (or a transform)."""

from shardlib.strategies.context import context_parallel
from shardlib.strategies.data import data_parallel
from shardlib.strategies.expert import expert_parallel
from shardlib.strategies.fsdp import fsdp
from shardlib.strategies.sequence import sequence_parallel
from shardlib.strategies.tensor import tensor_parallel
from shardlib.strategies.tensor2d import tensor_2d
from shardlib.strategies.tensor3d import tensor_3d

__all__ = [
    "context_parallel",
    "data_parallel",
    "expert_parallel",
    "fsdp",
    "sequence_parallel",
    "tensor_2d",
    "tensor_3d",
    "tensor_parallel",
]
