"""3D tensor parallelism over ``tensor x tensor2 x tensor3`` (cf. Colossal-AI's 3D mode).

Colossal-AI's 3D mode (Bian et al. 2021) places a q x q x q cube of devices so that each
matmul is split over all three axes and parameters, activations and compute all shrink by
q³. As GSPMD rules the cube is the 2D tiling (tensor2d.py) with its *row* role spread over
two axes: Megatron's dims and the residual width over ``tensor``, every weight's ``embed``
dim and the batch over ``tensor2 x tensor3``. Parameters and activations shrink by the
product of the three axes, as in Colossal-AI; the communication pattern is the 2D one (row
all-gathers of weights over a q² group, column gather/scatter of the residual), not the
cube's broadcast-reduce schedule. benchmarks/attention.py prints the measured figures.
"""

from shardlib.core.mesh import Axis
from shardlib.core.rules import MEGATRON_DIMS, Rules


def tensor_3d(
    *, column: str = Axis.TENSOR, row: str = Axis.TENSOR2, depth: str = Axis.TENSOR3
) -> Rules:
    """Megatron's splits over ``column``; weights' embed and the batch over ``row x depth``."""
    megatron = {name: (column,) for name in MEGATRON_DIMS}
    return Rules(
        params={**megatron, "embed": (row, depth)},
        activations={**megatron, "batch": (row, depth), "res_embed": (column,)},
    )
