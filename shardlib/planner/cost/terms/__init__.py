"""One small module per strategy's cost: memory it adds, collectives it runs, FLOPs it adds.

``state`` (parameters, gradients, optimizer state under every split), ``model`` (FLOPs and
saved activations), ``dp`` (with ZeRO-1/2), ``onebit`` (1-bit Adam/LAMB's compressed
momentum), ``fsdp``, ``tensor``, ``tensor25d`` (2D/2.5D grids), ``context``, ``expert``,
``pipeline`` (and ``chimera``'s doubled weights, ``terapipe``'s K/V buffers, ``two_bw``'s
stale weights), ``remat``, ``offload``, ``loss``: each describes what the trainer's compiled
program does, and ``benchmarks/planner_validation.py`` checks them against compiled
executables.

Each module declares one ``declare.Term``: its cost, the mesh axis and search values it
owns, and its hooks. ``TERMS`` lists them; ``cost.total`` adds their costs up and ``search``
sizes their axes, and neither names a strategy. Adding a strategy to the planner is one
term module and one entry in each tuple below.
"""

from collections.abc import Callable

from shardlib.planner.cost.terms import (
    chimera,
    context,
    dp,
    expert,
    fsdp,
    loss,
    model,
    offload,
    onebit,
    pipeline,
    remat,
    state,
    tensor,
    tensor25d,
    terapipe,
    two_bw,
)
from shardlib.planner.cost.terms.declare import SearchAxis, Terms

TERMS = Terms(
    (
        state.TERM,
        model.TERM,
        dp.TERM,
        onebit.TERM,
        fsdp.TERM,
        tensor.TERM,
        tensor25d.TERM,
        context.TERM,
        expert.TERM,
        pipeline.TERM,
        chimera.TERM,
        terapipe.TERM,
        two_bw.TERM,
        remat.TERM,
        offload.TERM,
        loss.TERM,
    )
)
"""Every term, in the order their shares are listed (they add, so the order changes no
total: it orders an estimate's parts and collectives). ``PlanView`` reads their settings in
this order, so a term may read the settings of those before it (the pipeline's micro-batch
count reads data's accumulation); the first term that cannot cost a plan names it."""

SEARCH_AXES: tuple[SearchAxis, ...] = (
    tensor.SEARCH_AXIS,
    context.SEARCH_AXIS,
    expert.SEARCH_AXIS,
    pipeline.SEARCH_AXIS,
    fsdp.SEARCH_AXIS,
    dp.SEARCH_AXIS,
)
"""Every mesh axis the search sizes, in the order it picks their sizes: each axis's
constraint may read the sizes of those before it, and the last one takes the devices that
are left (data, as ``-1`` does in a mesh preset). This order decides only which of equally
fast plans is listed first; the mesh order is ``placement``'s."""


def hooks(name: str) -> tuple[Callable, ...]:
    """The registered terms' hooks called ``name`` (``Term`` fields) that are set, in
    ``TERMS`` order."""
    return TERMS.hooks(name)
