"""Data parallelism: split the batch, replicate everything else.

Gradients of replicated parameters are summed across the axis by XLA (one all-reduce per
step, 2(N-1)/N of the gradient bytes on the wire); no communication is written here.
"""

from shardlib.mesh import Axis
from shardlib.rules import Rules


def data_parallel(*, axis: str = Axis.DATA) -> Rules:
    """Activations' ``batch`` dim over ``axis``; parameters stay replicated."""
    return Rules(activations={"batch": (axis,)})
