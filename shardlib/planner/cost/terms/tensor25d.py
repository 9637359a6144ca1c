"""2D and 2.5D tensor parallelism (``parallel/tensor25d.py``; Tesseract, Wang et al. 2021):
the collectives of the grid ``tensor_depth x tensor2 x tensor`` (d x q x q; d = 1 is 2D),
and 3D (``parallel/tensor3d.py``), which is the 2D grid with its rows over
``tensor2 x tensor3``: below, q is then the rows' size and "over ``tensor2``" means over both
(d = 1; the search does not try 3D: ``estimate`` costs a given 3D plan).

Per layer and device, as the compiled program runs them (tests/parallel/test_tensor25d.py
checks the same counts against the HLO):

- each weight matrix gathered over ``tensor2`` twice (forward, backward) and its gradient
  reduce-scattered over it: 3(q-1)·W/q² on the wire, Tesseract's weight term;
- each weight's gradient all-reduced over ``tensor_depth``: 2(d-1)/d·W/q² (the d layers
  saw different tokens; weights are replicated over depth);
- the residual stream gathered over ``tensor`` before each block and reduce-scattered after
  it, forward and backward: 8 moves of the B/(dq) tokens' width, 8(q-1)·B·h/(dq²).

``[parallel.tensor] products = "summa"`` (``grid_depth`` >= 1, searched beside megatron:
the ``products`` knob) moves no residual: each of the block's four products gathers its
input over ``tensor`` twice (forward, and again for dW) and reduce-scatters its dX, on the
input's width (``summa_moves``: Tesseract's three activation terms,
``tensor25d_traffic.ACTIVATION_KINDS``); it saves every h-wide buffer split over ``tensor``
and holds the widest product's gathered X and whole dX once in the backward
(``_summa_working``). Compiled (llama-7b, 8 layers, 64-device grids,
``benchmarks/tensor25d_scale.py`` rows 13-16): memory 0.968-1.001, wire 0.986-1.014;
priced as megatron they read 0.897-1.028 and 0.718-0.813. Remat policies but none and full
are not costed with summa (``_summa_unmodelled``).

Outside the layers the embedding and head tables follow FSDP's pattern over ``tensor2``
(one gather for the lookup, two for the head, one gradient reduction each) plus the depth
all-reduce, and the lookup and logits move the tokens' width over ``tensor`` a few times.
The batch is split over ``tensor2 x tensor_depth`` (``Term.axis_splits``), so the model
term's FLOPs and saved activations are per d·q of the tokens; parameters follow the rules.

The search tries the searched ``tensor`` size t also as a d x q x q grid (``grid_depth`` = d;
0 is Megatron's 1D; ``GRID_DEPTHS``), on meshes whose other axes are data only: the
combinations with FSDP, context, experts or stages are not measured against the compiler.
Every plan of ``benchmarks/tensor25d_scale.py`` (7B/13B width on 64-256 devices, remat none,
selective and full, ZeRO-1/2, 3D) reads 0.91-1.03 predicted / compiled memory;
``shardlib plan --no-tensor-grid`` searches 1D alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import Axis
from shardlib.parallel.tensor import PRODUCTS
from shardlib.parallel.tensor25d_traffic import ACTIVATION_KINDS, workload_products
from shardlib.planner.cost.terms.base import MASTER_BYTES, Comm, Contribution, Step
from shardlib.planner.cost.terms.declare import Knob, Term
from shardlib.planner.cost.terms.pipeline_loop import layer_runs
from shardlib.planner.cost.terms.remat import KEPT, per_layer

WEIGHT_GATHERS = 2
"""Gathers of each weight over ``tensor2`` per layer run: forward and backward."""
RESIDUAL_MOVES = 8
"""The residual's gathers and reduce-scatters over ``tensor`` per layer run (2 blocks x
gather and scatter x forward and backward)."""
EXTRA_GATHER_2D = 1
"""At d = 1 XLA's partitioner gathers the attention output projection's dY twice in the
backward (jax 0.10.2; tests/parallel/test_tensor25d.py): one more per layer run."""
RECOMPUTED_GATHERS, RECOMPUTED_SCATTERS = 2, 1
"""What ``remat=full``'s recomputed forward moves again over ``tensor`` per layer run: the
normed residual's two gathers (before qkv, before gate/up) and the attention output's
reduce-scatter (the MLP's output is not needed for the backward); over ``tensor2`` it
gathers the column products' weights again (compiled, jax 0.10.2: the row products' gathers
are shared with the backward's)."""
SUMMA_NOT_RECOMPUTED = 1
"""Products at the end of a block whose input ``remat=full``'s recomputed forward does not
gather again under summa: MLP-down's output is not needed for the backward (compiled,
llama-small, jax 0.10.2: the recomputed forward gathers qkv's, the out projection's and
gate/up's inputs, not down's). The norms' statistics (an all-reduce of one scalar per
token, under 1% of the tensor axis's bytes) are not booked."""
OUTSIDE_GATHERS = {"embedding": 1, "lm_head": 2}
"""Gathers over ``tensor2`` of the tables outside the layers (the head's forward and
backward, the lookup's forward)."""
OUTSIDE_MOVES = {"reduce-scatter": 2, "all-gather": 1, "all-to-all": 1}
"""Width-of-the-tokens collectives over ``tensor`` outside the layers: the lookup's and the
head's reduce-scatters, the final norm's gather, the lookup gradient's all-to-all."""


def grid_active(view) -> bool:
    """A 2D, 2.5D or 3D plan: a ``tensor2`` axis (3D adds ``tensor3``)."""
    return view.get(Axis.TENSOR2, 1) > 1


def _row_axes(view) -> tuple[str, ...]:
    """The grid's row role: ``tensor2``, or ``tensor2 x tensor3`` in 3D (``tensor3d.py``:
    3D is the 2D tiling with the rows spread over two axes)."""
    three = view.get(Axis.TENSOR3, 1) > 1
    return (str(Axis.TENSOR2), *((str(Axis.TENSOR3),) if three else ()))


def _gathered(step: Step, per_layer: bool, names=None, columns: bool = False) -> float:
    """Elements of the matrices split over ``tensor2`` as one device gathers them (``columns``:
    only the column products', whose input dim is ``embed``: qkv, gate and up)."""
    total = 0.0
    for param, _ in step.table:
        if param.per_layer != per_layer or len(param.dims) < 2:
            continue
        if names is not None and param.name not in names:
            continue
        if columns and param.dims[0][0] != "embed":
            continue
        if Axis.TENSOR2 in step.splits[param.name]:
            total += param.numel / step.shard(param, without=_row_axes(step.view))
    return total


def grid(step: Step) -> Contribution:
    view, w = step.view, step.workload
    if not grid_active(view):
        return Contribution()
    rows, cols, depth = _row_axes(view), (str(Axis.TENSOR),), (str(Axis.TENSOR_DEPTH),)
    q, d = math.prod(view[a] for a in rows), view.get(Axis.TENSOR_DEPTH, 1)
    e, scatter = w.compute_bytes, step.scatter_kind
    runs, layers = layer_runs(step), step.layers_per_device
    layer = _gathered(step, True)
    width = step.micro_batch * step.local_seq * w.embed * e  # B/(dq) tokens' residual
    t, full = view["tensor"], per_layer(view.remat) == "full"
    comms = [
        Comm("tensor25d", "weights", "all-gather", rows, q, layer * e, WEIGHT_GATHERS * runs, True),
        # each micro-batch's dW is reduced inside its backward (the SUMMA reduction), not
        # once after accumulation: per layer run
        Comm("tensor25d", "grads", scatter, rows, q, layer * MASTER_BYTES, runs, True),
    ]  # fmt: skip
    if _products(view) == "summa":
        comms += summa_moves(step, scatter, runs)
    else:
        gathers = RESIDUAL_MOVES / 2 + (EXTRA_GATHER_2D if d == 1 else 0)
        scatters = RESIDUAL_MOVES / 2
        if full:  # the recomputed forward, up to the MLP's product
            gathers += RECOMPUTED_GATHERS
            scatters += RECOMPUTED_SCATTERS
        comms += [
            Comm("tensor25d", "activations", "all-gather", cols, t, width, gathers * runs, False),
            Comm("tensor25d", "activations", scatter, cols, t, width, scatters * runs, False),
        ]
    if full:  # the column products' weights, gathered again
        again = _gathered(step, True, columns=True) * e
        comms.append(Comm("tensor25d", "recompute", "all-gather", rows, q, again, runs, True))
    outside, m = 0.0, view.microbatches
    for name, gathers in OUTSIDE_GATHERS.items():
        table = _gathered(step, False, {name})
        outside += table
        comms += [
            Comm("tensor25d", name, "all-gather", rows, q, table * e, gathers, True),
            Comm("tensor25d", f"{name} grads", scatter, rows, q, table * MASTER_BYTES, m, True),
        ]
    for kind, moves in OUTSIDE_MOVES.items():
        kind = scatter if kind == "reduce-scatter" else kind
        comms.append(Comm("tensor25d", "lookup and logits", kind, cols, t, width, moves * m, False))
    if d > 1:  # weights replicated over depth: their gradients summed over it, per micro-batch
        held = (layer * layers + outside) / q * MASTER_BYTES
        comms.append(Comm("tensor25d", "grads", "all-reduce", depth, d, held, m, True))
    # gathered copies live at once, as FSDP's (the same fitted shares: an all-gather over
    # one axis before use), and a layer's gradient as computed, [m, n/q] before its scatter
    # (``terms.state`` books its held [m/q, n/q] part)
    c = step.calib
    transient = (c["fsdp_layers_live"] * layer + c["fsdp_outer_live"] * outside) * e
    transient += c["grad_layers_live"] * layer * (1 - 1 / q) * MASTER_BYTES
    return Contribution(memory={"gathered weights": transient}, comms=tuple(comms))


def summa_moves(step: Step, scatter: str, runs: float) -> list[Comm]:
    """``products = "summa"``'s activation collectives over ``tensor``: each of Tesseract's
    three activation terms (``tensor25d_traffic.ACTIVATION_KINDS``) of each of the block's
    products, on its input's width m, for the B/(dq) tokens of a micro-batch (the compiled
    bytes are ``summa_terms``' to the byte: tests/parallel/test_tensor25d.py); no residual
    moves. Under ``remat=full`` the recomputed forward gathers the inputs again, but the
    last product's (``SUMMA_NOT_RECOMPUTED``)."""
    w, cols, t = step.workload, (str(Axis.TENSOR),), step.view["tensor"]
    tokens = step.micro_batch * step.local_seq
    products = workload_products(w)
    e, width = w.compute_bytes, sum(p.m for p in products)
    comms = [
        Comm("tensor25d", term, scatter if kind == "reduce-scatter" else kind, cols, t,
             tokens * width * e, runs, False, len(products))
        for term, kind in ACTIVATION_KINDS.items()
    ]  # fmt: skip
    if per_layer(step.view.remat) == "full":  # the recomputed forward's X forward gathers
        again = products[:-SUMMA_NOT_RECOMPUTED]
        width = sum(p.m for p in again)
        comms.append(Comm("tensor25d", "recompute", "all-gather", cols, t, tokens * width * e,
                          runs, False, len(again)))  # fmt: skip
    return comms


def _summa_working(step: Step, micro_batch: int) -> float:
    """Live once under summa, in the backward of the widest product (MLP-down): its input
    gathered again for dW and its dX as partial sums, both [B/(dq), m] at full width m before
    the reduce-scatter (megatron's row product holds dY gathered, n = embed wide, and no
    whole-width dX). Compiled (llama-7b, tensor2=4 x tensor=4, 2 and 4 layers): summa's
    per-layer memory is the booked one's (1.5 h-wide buffers fewer than megatron's) and its
    layer-independent part 0.37 GiB above megatron's; this books 0.34."""
    if _products(step.view) != "summa":
        return 0.0
    w = step.workload
    width = max(w.embed, w.heads * w.head_dim, w.mlp)
    return 2 * micro_batch * step.local_seq * width * w.compute_bytes


def _summa_unmodelled(view) -> str:
    """Summa with a remat policy other than none and full: its products are custom VJPs
    (``tensor25d.summa_product``), whose outputs a dots policy does not save, so
    ``selective`` compiles to full's program (llama-7b, data=4 x 4 x 4: 3.223 GiB and the
    tensor axis's bytes of remat=full), which the cost model does not book as selective."""
    if _products(view) == "summa" and view.remat not in ("none", "full"):
        return f"remat={view.remat} with products=summa"
    return ""


def _products(view) -> str:
    """``[parallel.tensor] products`` of a grid plan (``megatron`` elsewhere)."""
    return view.plan.tensor.products if _depth_of(view) else "megatron"


GRID_DEPTHS = (0, 1, 2, 4, 8, 16)
"""``grid_depth`` values the search tries when asked to search grids: 0 (1D), then d."""


def grid_axes(tensor: int, depth: int) -> tuple[tuple[str, int], ...]:
    """``tensor``'s t devices as (tensor_depth, tensor2, tensor) = (d, q, q) for
    ``grid_depth`` = d >= 1 (no tensor_depth axis at d = 1: 2D); ShardingError if t is not
    d·q² with q >= 2."""
    q = math.isqrt(tensor // depth) if depth >= 1 and tensor % depth == 0 else 0
    if q < 2 or depth * q * q != tensor:
        fits = [d for d in range(1, tensor + 1) if tensor % d == 0 and _square(tensor // d)]
        raise ShardingError(
            f"grid_depth={depth} with tensor={tensor}: a 2D/2.5D grid arranges the tensor "
            f"devices as d x q x q (q >= 2). Fix: grid_depth one of "
            f"{', '.join(map(str, fits)) or 'none (tensor is not d·q²)'}, or 0 (1D)."
        )
    axes = ((str(Axis.TENSOR_DEPTH), depth),) if depth > 1 else ()
    return (*axes, (str(Axis.TENSOR2), q), (str(Axis.TENSOR), q))


def _square(n: int) -> bool:
    return n >= 4 and math.isqrt(n) ** 2 == n


def _depths(mesh: Mapping[str, int], space) -> list[int]:
    """The menu's depths this mesh runs: tensor = d·q² (q >= 2), no axis but data beside."""
    t = mesh.get(str(Axis.TENSOR), 1)
    others = all(s == 1 for a, s in mesh.items() if a not in (str(Axis.DATA), str(Axis.TENSOR)))
    grids = [d for d in space.menu("grid_depth") if d >= 1 and t % d == 0 and _square(t // d)]
    return ([0] if 0 in space.menu("grid_depth") else []) + (grids if others else [])


def _choices(workload, mesh: Mapping[str, int], space) -> list[dict]:
    """Each depth of the menu; a grid in each form of its products of the menu (megatron
    and summa: summa moves more bytes and saves less, so it wins only where memory binds;
    on ``plan --model llama-70b`` over 512 H100s it adds 18 plans to 2856)."""
    return [
        {"grid_depth": d, "products": p} if d else {"grid_depth": d}
        for d in _depths(mesh, space)
        for p in (space.menu("products") if d else ("megatron",))
    ]


def _allows(workload, mesh: Mapping[str, int], knobs: Mapping[str, Any]) -> bool:
    """Each micro-batch's rows split over the grid's depth x rows (the trainer's check)."""
    d = knobs.get("grid_depth", 0)
    if d == 0:
        return True
    # grids are offered beside data only (``_depths``): data alone splits the batch
    rows = workload.global_batch // mesh[str(Axis.DATA)] // knobs["microbatches"]
    return rows % (d * math.isqrt(mesh[str(Axis.TENSOR)] // d)) == 0


def _bounds(mesh: Mapping[str, int], space, m: int) -> list[dict]:
    """Each form of the tensor devices bounds its own plans (a grid can move fewer
    critical-path bytes than 1D): one bound per depth tried."""
    depths = _depths(mesh, space)
    return _choices(None, mesh, space) if depths != [0] else []


def _residual_split(step: Step, policy: str) -> tuple[float, int]:
    """The two norms' inputs (the block input and the residual between attention and MLP)
    stay split over ``tensor`` as the residual stream is (``res_embed``); the norms' outputs
    are saved gathered (the column products' dW reuses them). ``full`` keeps only the
    input, which ``remat.saved_input_split`` already splits."""
    if not grid_active(step.view) or policy not in ("none", "selective"):
        return 0.0, 1
    # summa keeps every product's input split (``tensor25d.summa_product``): the norms'
    # outputs too, so every h-wide saved buffer
    split = KEPT[policy]["h"] if _products(step.view) == "summa" else 2.0
    return split, step.view[str(Axis.TENSOR)]


def _head_split(step: Step) -> int:
    """The h-wide fp32 buffers ``head_h`` books are the residual stream's (fitted on 1D
    programs, where it is whole: the head's input and gradient, a layer's residual adds),
    and a grid keeps that stream split over ``tensor``. Compiled (llama-7b, data=4 x 4 x 4,
    selective and full): the only whole-width ones at the peak are the lookup's two outputs
    before their reduce-scatter; booked whole, the head over-booked 0.55 GiB of 4.0 and
    3.0 GiB (``benchmarks/tensor25d_scale.py`` rows 3 and 12)."""
    return step.view[str(Axis.TENSOR)] if grid_active(step.view) else 1


def _depth_of(view) -> int:
    """``grid_depth`` of a plan: 0 for 1D and 3D (not a Tesseract grid)."""
    if not grid_active(view) or view.get(str(Axis.TENSOR3), 1) > 1:
        return 0
    return view.get(str(Axis.TENSOR_DEPTH), 1)


def _knobs_text(view) -> str:
    if view.get(str(Axis.TENSOR3), 1) > 1:
        return "3d"
    summa = " summa" if _products(view) == "summa" else ""
    return f"2.5d d={d}{summa}" if (d := _depth_of(view)) else ""


TERM = Term(
    "tensor25d",
    cost=grid,
    axis_splits={str(a): ("batch",) for a in (Axis.TENSOR2, Axis.TENSOR3, Axis.TENSOR_DEPTH)},
    knobs=(Knob("grid_depth", GRID_DEPTHS), Knob("products", PRODUCTS)),
    settings=lambda view: {"grid_depth": _depth_of(view), "products": _products(view)},
    knobs_text=_knobs_text,
    choices=_choices,
    allows=_allows,
    bounds=_bounds,
    residual_split=_residual_split,
    working=_summa_working,
    unmodelled=_summa_unmodelled,
    head_split=_head_split,
)
