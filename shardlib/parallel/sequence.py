"""Megatron sequence parallelism (Korthikanti et al. 2022), as one rule.

With plain tensor parallelism the residual stream, the norms and dropout are replicated
over the tensor axis, and each attention/MLP block ends in an all-reduce of the b·s·h
residual. Splitting the residual stream's tokens (``res_seq``) over the same axis turns
that all-reduce into a reduce-scatter (block output -> s/t tokens) plus an all-gather
(s/t tokens -> the block's full-sequence input): the same bytes on the wire, but the norms
and the residual adds run on s/t tokens and store s/t of their activations. Inside the
blocks the layout is tensor parallel's (``seq`` whole, heads/mlp split), so nothing else
changes; XLA places the gather and the scatter from the two layouts.
"""

from shardlib.core.mesh import Axis
from shardlib.core.rules import Rules


def sequence_parallel(*, axis: str = Axis.TENSOR) -> Rules:
    """The residual stream's tokens over ``axis`` (compose with ``tensor_parallel(axis)``)."""
    return Rules(activations={"res_seq": (axis,)})
