"""One small module per strategy's cost: memory it adds, collectives it runs, FLOPs it adds.

``state`` (parameters, gradients, optimizer state under every split), ``model`` (FLOPs and
saved activations), ``dp`` (with ZeRO-1/2), ``fsdp``, ``tensor``, ``context``, ``expert``,
``pipeline``, ``remat``, ``offload``: each describes what the trainer's compiled program
does, and ``benchmarks/planner_validation.py`` checks them against compiled executables.
``planner.cost`` adds them up.

The terms that own a mesh axis declare it (``SEARCH_AXIS``, a ``base.SearchAxis``);
``SEARCH_AXES`` lists them. Adding a strategy to the planner is one term module with its
declaration, and one entry here and in ``cost.contributions``.
"""

from shardlib.planner.cost.terms import context, dp, expert, fsdp, pipeline, tensor
from shardlib.planner.cost.terms.base import SearchAxis

SEARCH_AXES: tuple[SearchAxis, ...] = (
    tensor.SEARCH_AXIS,
    context.SEARCH_AXIS,
    expert.SEARCH_AXIS,
    pipeline.SEARCH_AXIS,
    fsdp.SEARCH_AXIS,
    dp.SEARCH_AXIS,
)
"""Every mesh axis the search sizes, in the order it picks their sizes: each axis's
constraint may read the sizes of those before it (stage reads context), and the last one
takes the devices that are left (data, as ``-1`` does in a mesh preset). This order decides
only which of equally fast plans is listed first; the mesh order is ``placement``'s."""
