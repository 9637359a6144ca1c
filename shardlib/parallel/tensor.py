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
from shardlib.parallel.tensor25d import grid, summa_product, summa_weights, tensor_25d

MODES = ("auto", "1d", "2d", "2.5d", "3d")
"""``[parallel.tensor] mode``: ``auto`` reads the form from the mesh axes; the others say it."""
PRODUCTS = ("megatron", "summa")
"""``[parallel.tensor] products`` of 2.5D: Megatron's column-then-row pairs or Tesseract's
SUMMA for every product (``parallel/tensor25d.py``)."""


def tensor_parallel(*, axis: str = Axis.TENSOR) -> Rules:
    """Heads, kv-heads, MLP hidden and vocab dims over ``axis``, for weights and activations.

    K/V heads fewer than (or not a multiple of) the tensor degree are replicated over
    ``axis`` instead (``Rules.replicate_indivisible``), as Megatron-LM and MaxText do: each
    device computes the K/V heads its query heads read (MQA on ``tensor=8``: the one K/V
    head on all eight), and the planner counts those weights once per device.
    """
    table = {name: (axis,) for name in MEGATRON_DIMS}
    return Rules(params=table, activations=table, replicate_indivisible=("kv_heads",))


@dataclass(frozen=True)
class TensorParallel:
    """``[parallel.tensor]``: Megatron 1D over ``tensor``, 2D/3D when the mesh also has
    ``tensor2`` (and ``tensor3``), 2.5D (Tesseract) with ``tensor2`` and ``tensor_depth``,
    and Megatron sequence parallelism on top of 1D."""

    axes: ClassVar[dict[str, str]] = {
        Axis.TENSOR: "Megatron tensor parallel (the column axis of 2D/3D)",
        Axis.TENSOR2: "second axis of 2D/3D tensor parallel (rows)",
        Axis.TENSOR3: "third axis of 3D tensor parallel (depth)",
        Axis.TENSOR_DEPTH: "depth d of 2.5D tensor parallel: splits the batch, weights replicated",
    }
    logical_names: ClassVar[dict[str, str]] = {}

    sequence_parallel: bool = False
    """Megatron-SP: split the residual stream's tokens over the tensor axis."""
    mode: str = "auto"
    """``auto``: the form the mesh axes give (tensor: 1d; + tensor2: 2d; + tensor_depth:
    2.5d; + tensor3: 3d). ``1d``/``2d``/``2.5d``/``3d`` say it, and the mesh is checked
    against it (2.5d: tensor_depth=d x tensor2=q x tensor=q; without tensor_depth, d = 1)."""
    products: str = "megatron"
    """How 2.5D runs a block's products (``parallel/tensor25d.py``, whose docstring says
    what each moves): ``megatron`` pairs a column product with a row product (fewer bytes,
    the default); ``summa`` runs every product as Tesseract's SUMMA (the paper's layout and
    collectives: the row products' weights laid out transposed and their inputs gathered
    again for dW). Only with mode='2.5d'."""

    def form(self, mesh_axes: Mapping[str, int]) -> str:
        """The form the mesh axes switch on (``mode`` checked against it)."""
        if Axis.TENSOR_DEPTH in mesh_axes:
            form = "2.5d"
        elif Axis.TENSOR3 in mesh_axes:
            form = "3d"
        elif Axis.TENSOR2 in mesh_axes:
            form = "2.5d" if self.mode == "2.5d" else "2d"
        else:
            form = "1d" if Axis.TENSOR in mesh_axes else "none"
        if self.mode not in MODES:
            raise ShardingError(
                f"parallel.tensor.mode={self.mode!r} is not a tensor-parallel form. Fix: use "
                f"one of {', '.join(MODES)}."
            )
        if self.mode not in ("auto", form):
            need = {
                "1d": "tensor",
                "2d": "tensor x tensor2",
                "2.5d": "tensor_depth x tensor2 x tensor (d x q x q)",
                "3d": "tensor x tensor2 x tensor3",
            }[self.mode]
            axes = " x ".join(f"{a}={s}" for a, s in mesh_axes.items())
            raise ShardingError(
                f"parallel.tensor.mode={self.mode!r} needs mesh axes {need}, but the mesh is "
                f"{axes} ({form}). Fix: give the mesh those axes, or set mode='auto'."
            )
        if form == "2.5d":
            grid(mesh_axes)  # a d x q x q arrangement, or a refusal naming the fix
        if self.products not in PRODUCTS or (self.products != "megatron" and form != "2.5d"):
            raise ShardingError(
                f"parallel.tensor.products={self.products!r} with the {form} form: the products "
                f"are one of {', '.join(PRODUCTS)}, and 'summa' is a form of 2.5D only. Fix: "
                "mode='2.5d' on a tensor_depth x tensor2 x tensor mesh, or products='megatron'."
            )
        return form

    def rules(self, mesh_axes: Mapping[str, int]) -> list[Rules]:
        form = self.form(mesh_axes)
        if form == "2.5d":  # d = 1 (no tensor_depth axis) is 2D
            summa = self.products == "summa"
            parts = [tensor_25d(summa=summa) if Axis.TENSOR_DEPTH in mesh_axes else tensor_2d()]
            parts += [summa_weights()] if summa else []
        elif Axis.TENSOR3 in mesh_axes:
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

    def ops(self, mesh_axes: Mapping[str, int]) -> dict:
        """The forms this strategy gives the model's ops (``ParallelPlan.ops``): SUMMA's
        products keep their inputs split for dW (``tensor25d.summa_product``)."""
        if self.products != "summa" or self.form(mesh_axes) != "2.5d":
            return {}
        return {"product": summa_product()}

    @staticmethod
    def _check_sequence_parallel(mesh_axes: Mapping[str, int]) -> None:
        if Axis.TENSOR not in mesh_axes:
            raise ShardingError(
                "sequence_parallel=true splits the residual stream over the tensor axis, which "
                "the mesh lacks. Fix: add a tensor axis, or set sequence_parallel=false."
            )
        if any(a in mesh_axes for a in (Axis.TENSOR2, Axis.TENSOR3, Axis.TENSOR_DEPTH)):
            raise ShardingError(
                "sequence_parallel=true with 2D/2.5D/3D tensor parallelism: both split the "
                "residual stream over the tensor axis (tokens vs width). Fix: drop one of them."
            )
