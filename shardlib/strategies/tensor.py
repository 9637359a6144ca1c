"""Megatron 1D tensor parallelism, as rules.

Column-parallel layers split their output dim (QKV projections over ``heads``/``kv_heads``,
MLP-in over ``mlp``), row-parallel layers split their input dim (attention-out over
``heads``, MLP-out over ``mlp``), so each attention and MLP block needs one all-reduce of
the b*s*h residual in forward and one in backward. The embedding and the output projection
are vocab-parallel. The activations' head and mlp dims follow the weights so that XLA keeps
the intermediate results split instead of gathering them.
"""

from shardlib.mesh import Axis
from shardlib.rules import Rules

_SPLIT = ("heads", "kv_heads", "mlp", "vocab")


def tensor_parallel(*, axis: str = Axis.TENSOR) -> Rules:
    """Heads, kv-heads, MLP hidden and vocab dims over ``axis``, for weights and activations."""
    table = {name: (axis,) for name in _SPLIT}
    return Rules(params=table, activations=table)
