"""One small module per parallelism form; each returns rules (or a transform)."""

from shardlib.parallel.context import context_parallel
from shardlib.parallel.data import data_parallel
from shardlib.parallel.expert import expert_parallel
from shardlib.parallel.fsdp import fsdp
from shardlib.parallel.sequence import sequence_parallel
from shardlib.parallel.tensor import tensor_parallel
from shardlib.parallel.tensor2d import tensor_2d
from shardlib.parallel.tensor3d import tensor_3d
from shardlib.parallel.tensor25d import tensor_25d

__all__ = [
    "context_parallel",
    "data_parallel",
    "expert_parallel",
    "fsdp",
    "sequence_parallel",
    "tensor_2d",
    "tensor_25d",
    "tensor_3d",
    "tensor_parallel",
]
