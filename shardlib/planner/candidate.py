"""The planner's candidates are ``ParallelPlan``s; ``PlanView`` reads the numbers terms need.

A candidate is the very object the trainer runs (``shardlib.parallel.plan.ParallelPlan``), so
what the planner costs, writes and validates is one description with no translation in
between. ``candidate(...)`` builds one from the search's knobs: the mesh axes with size > 1
in ``AXIS_ORDER`` and the sections those knobs set. ``PlanView`` is a read-only lens on a
plan (its axis sizes, and the settings each term reads from its own section): it keeps
nothing the plan does not say.

Mesh axes are always laid out in ``AXIS_ORDER`` (outermost first), the order of the
``placement`` each planner term declares for its axis (``planner.cost.terms.SEARCH_AXES``;
each declaration says why it sits where it does). The last axes vary fastest over device
ids and so stay inside a host: an axis with an all-reduce on the critical path of every
layer goes innermost, per-layer traffic that overlaps compute next, and a once-per-step
gradient reduction or small point-to-point sends, which tolerate a slow link, outermost.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

from shardlib.core.mesh import Axis, MeshSpec
from shardlib.parallel.context import ContextParallel
from shardlib.parallel.data import DataParallel
from shardlib.parallel.loss import LossChunks
from shardlib.parallel.offload import Offload
from shardlib.parallel.pipeline.gpipe import PipelineParallel
from shardlib.parallel.plan import ParallelPlan
from shardlib.parallel.remat import Remat
from shardlib.parallel.tensor import TensorParallel
from shardlib.planner.cost.terms import SEARCH_AXES, TERMS, hooks
from shardlib.planner.cost.terms.remat import REMAT
from shardlib.planner.cost.terms.tensor25d import grid_axes

__all__ = ["AXIS_ORDER", "REMAT", "PlanView", "batch_ways", "candidate"]

AXIS_ORDER: tuple[Axis, ...] = tuple(a.axis for a in sorted(SEARCH_AXES, key=lambda a: a.placement))
"""The searched mesh axes, outermost first (by their terms' ``placement``)."""
BATCH_AXES: tuple[str, ...] = tuple(str(a.axis) for a in SEARCH_AXES if "batch" in a.splits)
"""Axes whose every index gets its own rows of the batch."""


def batch_ways(sizes: Mapping[str, int]) -> int:
    """Ways the batch is split over the mesh ``sizes`` (absent axes: 1)."""
    return math.prod(sizes.get(a, 1) for a in BATCH_AXES)


def candidate(
    *,
    zero: int = 0,
    microbatches: int = 1,
    schedule: str = "gpipe",
    virtual: int = 1,
    split_saved: bool = False,
    remat: str = "none",
    offload: bool = False,
    attention: str = "auto",
    loss_chunk: int = 0,
    grid_depth: int = 0,
    products: str = "megatron",
    **sizes: int,
) -> ParallelPlan:
    """The ``ParallelPlan`` of one point of the search space.

    ``sizes`` are the mesh axis sizes by name (``data=8, tensor=2``; absent axes are 1).
    ``microbatches`` are the pipeline's with a stage axis (``pipeline.microbatches``) and
    gradient accumulation without one (``data.microbatches``): the cost model has one count.
    ``schedule``, ``virtual`` and ``split_saved`` are ``PipelineParallel``'s (gpipe, 1f1b,
    circular = interleaved; ``split_saved_inputs``); ``offload`` keeps the optimizer state
    on the host. ``attention`` is ``attention_impl`` (``auto``: costed as the trainer picks on
    the cluster's devices; the published 2021 programs pin ``dense``); ``loss_chunk`` is
    ``parallel.loss.chunk`` (the head and loss in slices of that many positions; 0: whole).
    ``grid_depth`` d >= 1 lays ``tensor``'s t devices out as a d x q x q Tesseract grid
    (``tensor_depth x tensor2 x tensor``, mode 2.5d; d = 1 is 2D); 0 keeps Megatron's 1D.
    ``products`` is the grid's ``[parallel.tensor] products`` (``megatron``, or ``summa``:
    Tesseract's SUMMA for every product, more activation bytes, less activation memory).
    """
    unknown = set(sizes) - {str(a) for a in AXIS_ORDER}
    if unknown:
        known = ", ".join(AXIS_ORDER)
        raise TypeError(f"candidate: no searched axis {sorted(unknown)}; axes: {known}.")
    axes = tuple((str(a), sizes[a]) for a in AXIS_ORDER if sizes.get(a, 1) > 1)
    if grid_depth:  # tensor's devices as d x q x q, in tensor's place (innermost)
        grid = grid_axes(sizes[str(Axis.TENSOR)], grid_depth)
        axes = tuple(p for a in axes for p in (grid if a[0] == Axis.TENSOR else (a,)))
    staged = sizes.get(str(Axis.STAGE), 1) > 1
    return ParallelPlan(
        mesh=_mesh(axes or ((str(Axis.DATA), 1),)),
        tensor=_tensor("2.5d" if grid_depth else "auto", products),
        data=_data(zero, 1 if staged else microbatches),
        pipeline=_pipeline(schedule, microbatches if staged else 0, virtual, split_saved),
        remat=_remat(remat),
        offload=_offload(offload),
        context=_context(attention),
        loss=_loss(loss_chunk),
    )


# sections are frozen: the search's thousands of candidates share them
_mesh = functools.lru_cache(maxsize=4096)(MeshSpec)
_data = functools.lru_cache(maxsize=256)(DataParallel)
_loss = functools.lru_cache(maxsize=16)(lambda chunk: LossChunks(chunk=chunk))
_context = functools.lru_cache(maxsize=8)(
    lambda attention: ContextParallel(attention_impl=attention)
)
_pipeline = functools.lru_cache(maxsize=256)(
    lambda schedule, m, virtual, split: PipelineParallel(
        schedule, m, virtual, split_saved_inputs=split and schedule == "1f1b"
    )
)
_remat = functools.lru_cache(maxsize=16)(Remat)
_tensor = functools.lru_cache(maxsize=8)(
    lambda mode, products: TensorParallel(mode=mode, products=products)
)
_offload = functools.lru_cache(maxsize=4)(lambda optimizer: Offload(optimizer=optimizer))


_SPLITS: dict[str, tuple[str, ...]] = {
    dim: tuple(str(a.axis) for a in SEARCH_AXES if dim in a.splits)
    + tuple(a for term in TERMS for a, dims in term.axis_splits.items() if dim in dims)
    for dim in ("batch", "seq", "layers")
}
"""Per dim of the step: the axes that split it (``SearchAxis.splits``, ``Term.axis_splits``)."""
_UNSPLIT = {str(a): 1 for a in AXIS_ORDER}
_SETTINGS = hooks("settings")
_OWN = frozenset(("plan", "sizes", "_ways"))


class PlanView(dict[str, int]):
    """What the cost terms read from a ``ParallelPlan``: a mapping of mesh axis sizes (every
    searched axis, 1 where the plan has none, and any other axis the plan has), and as
    attributes the settings each term reads from its own section (``Term.settings``:
    ``view.microbatches``). Derived once when the view is made (the search reads these
    numbers millions of times); the plan is the only input.
    """

    def __init__(self, plan: ParallelPlan):
        super().__init__(_UNSPLIT)
        self.update(plan.mesh.axes)
        self.plan = plan
        self.sizes: dict[str, int] = dict(plan.mesh.axes)
        """The axes the plan has, and their sizes."""
        self._ways = {dim: math.prod(self.get(a, 1) for a in axes) for dim, axes in _SPLITS.items()}
        for settings in _SETTINGS:  # in ``TERMS`` order: a term may read those before it
            self.__dict__.update(settings(self))

    @property
    def settings(self) -> dict[str, Any]:
        """Each term's settings (``Term.settings``) by name."""
        return {k: v for k, v in self.__dict__.items() if k not in _OWN}

    def ways(self, dim: str) -> int:
        """Ways the axes that split ``dim`` (batch, seq, layers: ``SearchAxis.splits``)
        split it together."""
        return self._ways[dim]

    @property
    def axes(self) -> tuple[tuple[str, int], ...]:
        return self.plan.mesh.axes

    @property
    def size(self) -> int:
        return math.prod(self.sizes.values())

    def mesh_text(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in self.axes)

    def knobs_text(self) -> str:
        """``zero1 circularx2 m=4 remat=full offload`` (``-`` when every knob is off): each
        term's own part (``Term.knobs_text``)."""
        parts = (term.knobs_text(self) for term in TERMS)
        return " ".join(p for p in parts if p) or "-"
