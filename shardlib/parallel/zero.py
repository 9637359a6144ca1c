"""ZeRO stages 0-3 as layouts of the training state, one knob (Rajbhandari et al. 2020).

ZeRO shards what plain data parallelism replicates over the ``data`` axis, one role of the
training state at a time. Each stage is only a choice of rules per role; XLA derives every
collective from the layouts:

* stage 1, optimizer state split: the update runs on each device's shard (the gradient is
  reduce-scattered into it) and the new parameters are all-gathered to their replicated
  layout. The gradient *buffer* (what micro-batches accumulate into) stays replicated.
* stage 2, gradients too: the accumulation buffer is split as well, so each micro-batch's
  gradient is reduce-scattered straight into a 1/N buffer.
* stage 3, parameters too: the FSDP rules, with ``data`` as the FSDP axis; weights are
  all-gathered just in time in forward and backward.

On GPU and TPU the gradient reduction of stages 1-3 is a reduce-scatter. The CPU backend
emits an all-reduce followed by a slice instead (REFERENCE.md, "Counting communication"),
so CPU wire bytes for the gradient are 2x those of the GPU program.

Hybrid sharding (HSDP) needs no stage of its own: a mesh ``data x fsdp`` shards every state
over ``fsdp`` (the FSDP strategy) and replicates it over ``data``; ``zero`` then shards
further over ``data`` as above.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import Axis
from shardlib.core.rules import Rules
from shardlib.parallel.fsdp import PARAM_DIMS


@dataclass(frozen=True)
class StateRules:
    """The rules for each role of the training state (activations come from ``params``)."""

    params: Rules
    """Parameters between steps and as the forward/backward pass reads them."""
    grads: Rules
    """The gradient buffer: micro-batch gradients accumulate in this layout."""
    opt_state: Rules
    """Optimizer state, and the layout in which gradients enter the update."""


def zero(
    rules: Rules,
    *,
    stage: int,
    mesh_axes: Mapping[str, int],
    axis: str = Axis.DATA,
) -> StateRules:
    """Rules per state role for ZeRO ``stage`` over mesh ``axis``, on top of ``rules``.

    Sharded roles split every parameter over ``axis`` along one dim, as FSDP does
    (``parallel.fsdp.PARAM_DIMS``, ``rules.SHARED_ORDER``) but never on vocab: the
    logits are not vocab-parallel over ``axis``, so the embedding and head tables split
    on embed (a vocab split would be resharded at every use). That is in addition to whatever
    ``rules`` already split that dim over (``fsdp`` in HSDP), outer mesh axes first.
    """
    if stage not in (0, 1, 2, 3):
        raise ShardingError(f"zero={stage}: ZeRO stages are 0, 1, 2 and 3.")
    if stage == 0:
        return StateRules(params=rules, grads=rules, opt_state=rules)
    if axis not in mesh_axes:
        raise ShardingError(
            f"zero={stage} shards state over mesh axis {axis!r}, which the mesh "
            f"({', '.join(f'{a}={n}' for a, n in mesh_axes.items())}) lacks. Fix: add a "
            f"{axis!r} axis (e.g. {axis}=8), or use zero=0: an 'fsdp' axis already shards "
            "parameters, gradients and optimizer state (ZeRO-3)."
        )
    have = rules.params.get("embed", ())
    if axis in have:
        raise ShardingError(
            f"zero={stage}: the parameter rule 'embed' -> {have} already uses {axis!r}. "
            "Fix: use zero=0 with these rules, or rules that replicate over it."
        )
    order = list(mesh_axes)
    split = {
        name: tuple(sorted((*rules.params.get(name, ()), axis), key=order.index))
        for name in PARAM_DIMS
        if name != "vocab"  # the logits are not vocab-split over ``axis``: tables on embed
    }
    sharded = dataclasses.replace(
        rules, params={**rules.params, **split}, shared=(*rules.shared, axis)
    )
    return StateRules(
        params=sharded if stage >= 3 else rules,
        grads=sharded if stage >= 2 else rules,
        opt_state=sharded,
    )
