"""2D tensor parallelism over ``tensor x tensor2``, in the spirit of Colossal-AI's 2D mode.

Colossal-AI's 2D mode (SUMMA, Xu et al. 2021) tiles both the activations X [tokens, h] and
the weights W [h, h'] over a q x q grid: X's tokens over one grid axis and its width over
the other, W's input dim over the first and output dim over the second; a matmul then
broadcasts blocks of X along rows and of W along columns in q steps. The same tiling as
GSPMD rules:

- the *column* axis (``tensor``) splits what Megatron splits (heads, kv-heads, mlp, vocab)
  in weights and activations, and the residual stream's width (``res_embed``);
- the *row* axis (``tensor2``) splits every weight's ``embed`` dim and the batch.

Parameters, gradients and optimizer state then shrink by q² and so does the residual
stream. XLA realises the products with all-gathers instead of SUMMA's broadcasts: the
weights are gathered over the row axis before use (as in FSDP) and the residual is gathered
over the column axis before each block and reduce-scattered after it (as in Megatron-SP,
but along the width). The benchmark (benchmarks/attention.py) prints what that costs next
to Colossal-AI's figures.
"""

from shardlib.core.mesh import Axis
from shardlib.core.rules import MEGATRON_DIMS, Rules


def tensor_2d(*, column: str = Axis.TENSOR, row: str = Axis.TENSOR2) -> Rules:
    """Megatron's splits over ``column``; weights' embed dim and the batch over ``row``."""
    megatron = {name: (column,) for name in MEGATRON_DIMS}
    return Rules(
        params={**megatron, "embed": (row,)},
        activations={**megatron, "batch": (row,), "res_embed": (column,)},
    )
