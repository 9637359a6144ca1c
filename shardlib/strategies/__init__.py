"""One small module per parallelism form; each returns rules (or a transform)."""

from shardlib.strategies.data import data_parallel
from shardlib.strategies.expert import expert_parallel
from shardlib.strategies.fsdp import fsdp
from shardlib.strategies.tensor import tensor_parallel

__all__ = ["data_parallel", "expert_parallel", "fsdp", "tensor_parallel"]
