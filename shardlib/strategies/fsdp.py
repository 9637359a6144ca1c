"""Fully sharded data parallelism (ZeRO stage 3).

The batch is split over ``axis`` as in data parallelism, and every parameter is split over
the same axis along its ``embed`` dim (every weight of a transformer has one). Gradients and
optimizer state take the parameters' layout, so all three shrink by N per device. XLA
inserts the all-gather of each weight before use and the reduction of its gradient.
"""

from shardlib.mesh import Axis
from shardlib.rules import Rules


def fsdp(*, axis: str = Axis.FSDP, param_dim: str = "embed") -> Rules:
    """Parameters split over ``axis`` along ``param_dim``; activations' ``batch`` too."""
    return Rules(params={param_dim: (axis,)}, activations={"batch": (axis,)})
