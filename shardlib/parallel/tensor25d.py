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

Parameter memory per device: m·n·e/q² per linear layer (Colossal-AI's 2.5D table:
parameters O(1/q²), activations and compute O(1/(dq²)); REFERENCE.md's Colossal-AI row).

Wire bytes: ``tensor25d_traffic.py`` lists Tesseract's terms per product (three weight
broadcasts or reductions over ``tensor2``, the depth all-reduce, three activation terms over
``tensor``) and what this form moves instead. The weight terms coincide collective for
collective; the activations move only at the residual stream (Megatron's column-then-row
pairing), fewer bytes than the paper's SUMMA count. Both fall as 1/d, the paper's point:
depth trades replicated weights for fewer activation bytes per device.
``tests/parallel/test_tensor25d.py`` compares the compiled HLO with each term.
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
