"""2.5D tensor parallelism (Tesseract) over ``tensor_depth x tensor2 x tensor``.

Tesseract (Wang, Xu, Bian and You, "Tesseract: Parallelize the Tensor Parallelism
Efficiently", ICPP 2022, arXiv:2105.14500; Colossal-AI's ``mode='2.5d'``) arranges
P = d·q² devices as d layers of a q x q grid. A linear layer Y = X·W with X [B, m] (B = b·s
tokens) and W [m, n] keeps

- W in q x q blocks [m/q, n/q], the same block on every layer: **replicated over depth**;
- X and Y in dq x q blocks [B/(dq), ·/q]: the tokens over depth x grid rows, the width over
  grid columns, so each layer runs 2D SUMMA on its own B/d tokens. d = 1 is 2D (SUMMA).

As GSPMD rules (this module) that is the 2D tiling of ``tensor2d.py`` plus one axis that
splits only the batch: Megatron's dims and the residual width over ``tensor`` (grid
columns), every weight's ``embed`` dim over ``tensor2`` (grid rows), the batch over
``tensor_depth x tensor2``. No weight is split over ``tensor_depth``, so weights, gradients
and optimizer state shrink by q² (not d·q²) and activations by d·q², as in the paper. No
explicit collective is needed: XLA gathers each weight over ``tensor2`` before use, gathers
the residual over ``tensor`` before each block and reduce-scatters it after, and sums the
weight gradients over ``tensor_depth`` (the depth layers saw different tokens).

Formulas (per device, per linear layer, forward + backward; B tokens, element bytes e):

- parameter memory: m·n·e/q² (Colossal-AI's 2.5D table: parameters O(1/q²), activations
  and compute O(1/(dq²)); REFERENCE.md's Colossal-AI row);
- Tesseract's SUMMA traffic: the forward broadcasts q blocks of X along grid rows and q of
  W along grid columns; the backward's dX = dY·Wᵀ broadcasts W and reduces dX blocks, and
  dW = Xᵀ·dY broadcasts X and reduces dW blocks (Colossal-AI's ``Matmul_AB_2p5D``,
  ``Matmul_ABT_2p5D``, ``Matmul_ATB_2p5D``). With a ring broadcast of a block costing
  (q-1)/q of it per device, q of them cost (q-1) blocks:

      V_summa = 3(q-1)·B·m·e/(dq²) + 3(q-1)·m·n·e/q²                         (1)

  which for B·m = m·n = M is Colossal-AI's bandwidth entry 3(q-1)(d+1)/(dq) in units of
  M·e/q (d = 1: 2D's 6(q-1)/q). The weight gradients' sum over depth, an all-reduce of
  each W block over the d layers, adds 2(d-1)/d·m·n·e/q² (the table leaves it out).

- the GSPMD form moves the same weight bytes as (1): per weight one gather over ``tensor2``
  in the forward, one in the backward and one reduce-scatter of its gradient, 3(q-1)·m·n·e/q²,
  plus the depth all-reduce. Its activation traffic differs from (1) by design: the blocks'
  inner products keep Megatron's column-then-row pairing (``tensor.py``), so activations
  move only at the residual stream, 4(q-1)·B·h·e/(dq²) per attention or MLP block (gather
  and reduce-scatter, forward and backward; at d = 1 XLA adds one more gather per layer),
  where (1) summed over the block's products moves 3(q-1)·B·Σm·e/(dq²). Both fall as 1/d,
  the paper's point: depth trades replicated weights for fewer activation bytes per device.

``tests/parallel/test_tensor25d.py`` compares the compiled HLO with these formulas.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import Axis
from shardlib.core.rules import MEGATRON_DIMS, Rules


def tensor_25d(
    *, column: str = Axis.TENSOR, row: str = Axis.TENSOR2, depth: str = Axis.TENSOR_DEPTH
) -> Rules:
    """Megatron's splits over ``column``, weights' embed over ``row``, the batch over
    ``depth x row`` (weights replicated over ``depth``)."""
    megatron = {name: (column,) for name in MEGATRON_DIMS}
    return Rules(
        params={**megatron, "embed": (row,)},
        activations={**megatron, "batch": (depth, row), "res_embed": (column,)},
    )


def summa_wire_bytes(tokens: int, m: int, n: int, *, q: int, d: int, e: int) -> tuple[float, float]:
    """Formula (1) for Y[tokens, n] = X[tokens, m]·W[m, n], per device, forward + backward:
    (activation bytes, weight bytes); the depth all-reduce, 2(d-1)/d·m·n·e/q², is apart."""
    return 3 * (q - 1) * tokens * m * e / (d * q**2), 3 * (q - 1) * m * n * e / q**2


def grid(mesh_axes: Mapping[str, int]) -> tuple[int, int]:
    """(d, q) of a 2.5D mesh, refusing one that is not a d x q x q arrangement."""
    axes = " x ".join(f"{a}={s}" for a, s in mesh_axes.items())
    depth = mesh_axes.get(Axis.TENSOR_DEPTH, 1)
    columns, rows = mesh_axes.get(Axis.TENSOR, 1), mesh_axes.get(Axis.TENSOR2, 1)
    devices = depth * columns * rows
    if Axis.TENSOR3 in mesh_axes:
        raise ShardingError(
            f"mesh {axes}: 2.5D tensor parallelism (tensor_depth) and 3D (tensor3) both add a "
            "third tensor axis. Fix: keep tensor_depth for 2.5D (weights replicated over it) "
            "or tensor3 for 3D (weights split over it), not both."
        )
    if columns != rows:  # (all ones: a one-device reference of the same axes, allowed)
        fits = [f"tensor_depth={devices // q**2}, tensor2={q}, tensor={q}"
                for q in range(2, devices + 1) if devices % q**2 == 0]  # fmt: skip
        hint = " or ".join(fits) if fits else f"d·q·q tensor devices (not {devices})"
        raise ShardingError(
            f"mesh {axes}: 2.5D tensor parallelism arranges its {devices} tensor devices as "
            f"d x q x q (tensor_depth x tensor2 x tensor), but tensor={columns} and "
            f"tensor2={rows} are not one grid size q. Fix: use {hint}."
        )
    return depth, columns
