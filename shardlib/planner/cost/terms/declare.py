"""How a planner term declares itself to the search and to ``cost.total``.

A strategy is one place (its ``ParallelPlan`` section, ``shardlib/parallel/``) plus one
planner term. A term module declares one ``Term``: its cost function (``base.Step`` ->
``base.Contribution``), the mesh axis it owns (``SearchAxis``) and its search values
(``Knob``), and the hooks through which the rest of the planner asks it what only it knows:
the settings it reads from its section, the activation parts it replaces, the axes its
replicas reduce gradients over, what it cannot cost. ``cost.total`` and ``search`` iterate
over the registered terms (``planner.cost.terms.TERMS``, a ``Terms``) and name none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shardlib.core.mesh import Axis
from shardlib.core.param_info import ParamInfo
from shardlib.core.workload import Workload
from shardlib.planner.cost.terms.base import Contribution, Step

if TYPE_CHECKING:  # candidate and search read the declarations below: types only here
    from shardlib.planner.candidate import PlanView
    from shardlib.planner.inputs.cluster import Cluster
    from shardlib.planner.search import Space


Admits = Callable[["Workload", "Cluster", Mapping[str, int], int], bool]
"""``admits(workload, cluster, chosen, size)``: may the axis take ``size`` (> 1), given the
sizes ``chosen`` for the axes before it in ``SEARCH_AXES``?"""


def admits_any(workload, cluster, chosen, size) -> bool:
    """No constraint of its own (the batch split is checked for every batch axis at once)."""
    return True


def unbounded(cluster) -> int | None:
    """No largest size of its own."""
    return None


@dataclass(frozen=True)
class SearchAxis:
    """A mesh axis a strategy owns, as the search sizes it (one per term that owns an axis)."""

    axis: Axis
    """The mesh axis."""
    placement: int
    """Where it sits in the mesh, outermost smallest. The last axes vary fastest over device
    ids and so stay inside a host (the fastest link): the axis whose collectives sit on the
    critical path of every layer goes innermost, once-per-step traffic outermost."""
    admits: Admits
    """Which sizes > 1 the axis may take (1, the axis absent, always may): the checks the
    search makes before costing, so that a size the trainer refuses is never enumerated."""
    splits: tuple[str, ...] = ()
    """Which dims of the step each index along the axis gets its own part of: ``batch``
    (rows: data, FSDP and expert replicas; the global batch must divide by the product of
    these sizes), ``seq`` (tokens of a sequence), ``layers`` (the stacked blocks)."""
    largest: Callable[[Cluster], int | None] = unbounded
    """The largest size the search tries unless ``Space.limits`` says otherwise."""
    rule: str = ""
    """The admission constraint in words, for the error when a fixed size is refused."""
    check: Callable[[Workload, PlanView], None] | None = None
    """``check(workload, view)``: the shape constraints of a given plan with this axis > 1,
    raising ShardingError (``cost.check`` runs it before costing)."""


@dataclass(frozen=True)
class Knob:
    """A setting of a term's section the search tries values of (``candidate``'s keyword
    and the ``PlanView`` setting of the same name)."""

    name: str
    values: tuple
    """The values tried unless the ``Space`` says otherwise; for a trade, lightest first."""
    trades: bool = False
    """Heavier values only ever trade step time for memory (remat, offload): once a value
    fits, the search skips the heavier ones."""


def _nothing(step: Step) -> Contribution:
    return Contribution()


def _costs_all(view: PlanView) -> str:
    return ""


def _own_only(settings: Mapping[str, Any]) -> tuple[dict[str, tuple], tuple[str, ...]]:
    return {k: (v,) for k, v in settings.items()}, ()


@dataclass(frozen=True)
class Term:
    """One strategy's planner term: its share of the step and the hooks through which the
    search and the other terms ask about it. Every hook but ``cost`` is optional."""

    name: str
    """The strategy's name (``Comm.strategy`` of its collectives)."""
    cost: Callable[[Step], Contribution] = _nothing
    """Its share of the step."""
    axis: SearchAxis | None = None
    """The mesh axis it owns, if any."""
    axis_splits: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Mesh axes its strategy switches on that the search does not size, each with the step
    dims it splits (as ``SearchAxis.splits``: 2.5D's ``tensor2`` and ``tensor_depth`` split
    the batch)."""
    knobs: tuple[Knob, ...] = ()
    """The settings of its section the search tries."""
    settings: Callable[[PlanView], Mapping[str, Any]] | None = None
    """The settings it reads from its section, by name (``PlanView``'s attributes)."""
    unmodelled: Callable[[PlanView], str] = _costs_all
    """A setting of its section the cost model does not describe ("" when none)."""
    knobs_text: Callable[[PlanView], str] = _costs_all
    """Its settings in a plan's one-line summary ("" at their defaults)."""
    reductions: Callable[[Step, ParamInfo], tuple] | None = None
    """How its replicas reduce a parameter's gradient, called when its axis is > 1 (see
    ``terms.dp``): ``((axes, bytes | None), ...)``, None to join the parameter's one
    reduction of its shard, bytes for a reduction of its own."""
    replicates: bool = False
    """Its axis holds whole replicas of every parameter (ZeRO shards over those)."""
    saved: Callable[[Step, str, Mapping[str, float]], Mapping[str, Any]] | None = None
    """``saved(step, policy, kept)``: the parts of one layer's saved activations per token it
    replaces (``terms.model``: ``attention`` elements, ``mlp`` addends), given the elements
    ``policy`` keeps by width (``terms.remat.saved_coefficients``)."""
    residual_split: Callable[[Step, str], tuple[float, int]] | None = None
    """``residual_split(step, policy)``: (h-wide elements per token of ``KEPT[policy]`` that
    its layout keeps split, the ways): 2.5D keeps the residual stream split over ``tensor``."""
    head_split: Callable[[Step], int] | None = None
    """Ways its layout splits the width of the h-wide fp32 buffers ``head_h`` books
    (``terms.model.head_activation_bytes``): 2.5D keeps the residual stream split over
    ``tensor`` outside the layers too; 1 where no term says."""
    scales_saved: Callable[[Step], float] | None = None
    """How many sets of its layers' saved activations a device keeps (a pipeline's trips)."""
    head_batch: Callable[[Step], int] | None = None
    """Sequences the loss head runs on at once, where it decides (else one micro-batch)."""
    logits_share: Callable[[Step], float] | None = None
    """The share of the head's tokens whose fp32 logits are live at once (a loss computed
    in slices of the sequence: one slice's); 1 where no term says."""
    working: Callable[[Step, int], float] | None = None
    """``working(step, micro_batch)``: activation bytes live once, for one layer's backward."""
    recomputes_scores: Callable[[Step], bool] | None = None
    """Whether its backward recomputes q·kᵀ whatever the remat policy."""
    exposed: Callable[[PlanView], bool] | None = None
    """Whether its collectives sit on the critical path of this plan whatever the compute."""
    window: str = "default"
    """What compute its overlappable collectives hide behind (``throughput.overlap_windows``)."""
    choices: Callable[[Workload, Mapping[str, int], Space], list[dict]] | None = None
    """The values of its knobs the search tries on one mesh (``candidate`` keywords)."""
    allows: Callable[[Workload, Mapping[str, int], Mapping[str, Any]], bool] | None = None
    """Whether one point (mesh sizes and every knob) is one its strategy runs."""
    fix: Callable[[Mapping[str, Any]], tuple[dict[str, tuple], tuple[str, ...]]] = _own_only
    """``--fix`` of its knobs: (the menus they become, axes every plan then needs)."""
    bounds: Callable[[Mapping[str, int], Space, int], list[dict]] | None = None
    """``bounds(mesh, space, m)``: knob values whose plans bound every plan on the mesh from
    below in critical-path collectives (``search.lower_bound``); [] when the plan of default
    knobs does."""


class Terms(tuple):
    """Terms in order, and for each hook (a ``Term`` field) the ones that set it, found once
    (the cost model asks them thousands of times per search)."""

    def hooks(self, name: str) -> tuple[Callable, ...]:
        found = self.__dict__.setdefault("_hooks", {})
        if name not in found:
            found[name] = tuple(h for term in self if (h := getattr(term, name)) is not None)
        return found[name]
