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

Two forms of the products (``[parallel.tensor] products``; ``tensor25d_traffic.py`` lists
each one's bytes term by term and says when each is cheaper):

- ``megatron`` (default): the rules above, one entry per logical name. qkv and gate/up are
  SUMMA's layout; the out projection and MLP-down, whose weights the table lays out
  transposed against Tesseract's, reduce their output over ``tensor`` instead of
  broadcasting their wider input, and dW reuses the forward's gathered X. The weight terms
  are the paper's; the whole layer moves 0.61 / 0.74 of its bytes (d = 1 / 2, q = 2).
- ``summa``: every product as the paper's. The row products' weights take their dims'
  axes swapped (``summa_weights``: ``Rules.per_weight``, so the model still names logical
  dims only) and each product keeps X split for its backward and gathers it again for dW
  (``summa_product``, an ``ops.ProductForm``). Every term is the paper's to the byte;
  more bytes, less activation memory.

Both fall as 1/d, the paper's point: depth trades replicated weights for fewer activation
bytes per device. ``tests/parallel/test_tensor25d.py`` compares the compiled HLO with each
term of both forms.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.core.errors import ShardingError
from shardlib.core.layout import active_layout
from shardlib.core.mesh import Axis
from shardlib.core.rules import MEGATRON_DIMS, Rules


def tensor_25d(
    *,
    column: str = Axis.TENSOR,
    row: str = Axis.TENSOR2,
    depth: str = Axis.TENSOR_DEPTH,
    summa: bool = False,
) -> Rules:
    """Megatron's splits over ``column``, weights' embed over ``row``, the batch over
    ``depth x row`` (weights replicated over ``depth``). ``summa``: the batch over ``row x
    depth`` instead, the same tokens per device in another order. With the row products'
    weights transposed (``summa_weights``) and the batch over ``depth x row``, XLA (jax
    0.10.2, CPU) moves dY with a collective-permute over ``tensor_depth x tensor2`` in
    each row product's backward and the gradients come out wrong (rel. err 0.47 at d=2,
    q=2); over ``row x depth`` neither happens. ``benchmarks/xla_summa_batch_order.py``
    reproduces it in plain JAX (two products, no shardlib): wrong on jax 0.10.2 and 0.12."""
    megatron = {name: (column,) for name in MEGATRON_DIMS}
    batch = (row, depth) if summa else (depth, row)
    return Rules(
        params={**megatron, "embed": (row,)},
        activations={**megatron, "batch": batch, "res_embed": (column,)},
    )


ROW_WEIGHTS = (("heads", "head_dim", "embed"), ("mlp", "embed"))
"""The second product of each Megatron pair (attention out, MLP down), W[m, n] with m the
pair's split width and n = embed: the weights Megatron's table lays out [m over columns,
n over rows], the transpose of Tesseract's."""


def summa_weights() -> Rules:
    """Tesseract's layout for the row products too: each ``ROW_WEIGHTS`` weight's input
    dim takes ``embed``'s axes (rows) and its ``embed`` dim the input's (columns)."""
    swapped = {names: {names[0]: "embed", "embed": names[0]} for names in ROW_WEIGHTS}
    return Rules(per_weight=swapped)


def summa_product(*, column: str = Axis.TENSOR):
    """``ops.ProductForm`` of the SUMMA form: ``einsum(spec, x, w)`` that keeps for its
    backward X [B, m] split over ``column`` on the width it contracts, as the residual
    stream is, and gathers it again there for dW (Tesseract's ATB broadcast of X, ``X for
    dW``) instead of keeping the gathered [B/(dq), m]. dX and dW are autodiff's."""

    def layouts(spec: str, x):
        inputs, out = spec.split("->")
        lhs, rhs = inputs.split(",")
        dim = next(i for i, c in enumerate(lhs) if c in rhs and c not in out)
        mesh, split = active_layout()[0], [P.UNCONSTRAINED] * x.ndim
        whole = list(split)
        split[dim], whole[dim] = str(column), None
        return NamedSharding(mesh, P(*split)), NamedSharding(mesh, P(*whole))

    def form(spec: str, x, w):
        if active_layout() is None:  # one device
            return jnp.einsum(spec, x, w)
        split, whole = layouts(spec, x)

        @jax.custom_vjp
        def product(x, w):
            return jnp.einsum(spec, x, w)

        def forward(x, w):
            return product(x, w), (jax.lax.with_sharding_constraint(x, split), w)

        def backward(saved, dy):
            x_split, w = saved
            with jax.named_scope(f"x_for_dW[{spec}]"):
                x = jax.lax.with_sharding_constraint(x_split, whole)  # X again, for dW
            return jax.vjp(partial(jnp.einsum, spec), x, w)[1](dy)

        product.defvjp(forward, backward)
        return product(x, w)

    return form


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
