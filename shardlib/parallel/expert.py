"""Expert parallelism (GShard, Switch): experts split over a mesh axis, tokens sent to them.

Rules: every parameter dim named ``expert`` (the leading dim of stacked expert weights) is
split over ``axis``, so each device holds E / N experts and never gathers the others. The
expert axis is also folded into the activations' ``batch`` (GShard): attention and the
router run data-parallel over it, and only the dispatched tokens cross it.

A dispatched tensor [groups, experts, capacity, embed] carries both a batch-like dim and the
expert dim, which cannot share one mesh axis. ``batch_no_expert`` names its groups dim: the
``batch`` axes without the expert axis, derived once by ``with_dispatched_batch``. Moving the
expert axis from the groups dim to the expert dim is exactly one all-to-all over ``axis``:

* ``einsum`` dispatch: the model re-constrains the tensor and XLA's propagation emits the
  all-to-all (the GShard formulation);
* ``shard_map`` dispatch: ``explicit_exchange``, installed into ``shardlib.core.ops.exchange``
  by ``ExpertParallel.ops``, writes the ``jax.lax.all_to_all`` explicitly.
Both move k * tokens * capacity_factor * embed elements per device, (N-1)/N of them on the
wire, once to dispatch and once to combine in forward, and twice more in backward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import jax

from shardlib.core.errors import ShardingError
from shardlib.core.layout import active_layout, constrain, mesh_axes
from shardlib.core.mesh import Axis
from shardlib.core.rules import Rules
from shardlib.core.shard_map import shard_map

__all__ = ["ExpertParallel", "expert_axis", "expert_parallel", "explicit_exchange"]


def expert_parallel(*, axis: str = Axis.EXPERT) -> Rules:
    """Expert dims of weights and activations over ``axis``; the batch folded over it too."""
    return Rules(
        params={"expert": (axis,)},
        activations={"expert": (axis,), "batch": (axis,)},
    )


DISPATCHES = ("einsum", "shard_map")


@dataclass(frozen=True)
class ExpertParallel:
    """``[parallel.expert]``: experts over the ``expert`` axis and how tokens reach them."""

    axes: ClassVar[dict[str, str]] = {Axis.EXPERT: "experts split; batch folded over it"}
    logical_names: ClassVar[dict[str, str]] = {
        "batch_no_expert": "groups dim of dispatched MoE tokens: batch axes minus the expert axis"
    }

    dispatch: str = "einsum"
    """einsum: XLA derives the all-to-all; shard_map: shardlib writes it explicitly."""

    def __post_init__(self) -> None:
        if self.dispatch not in DISPATCHES:
            raise ShardingError(
                f"dispatch={self.dispatch!r}. Fix: use one of {', '.join(DISPATCHES)}."
            )

    def rules(self, mesh_axes: Mapping[str, int]) -> list[Rules]:
        return [expert_parallel(axis=Axis.EXPERT)] if Axis.EXPERT in mesh_axes else []

    def refine(self, rules: Rules) -> Rules:
        """The composed rules with ``batch_no_expert`` derived (``with_dispatched_batch``)."""
        return with_dispatched_batch(rules)

    def ops(self, mesh_axes: Mapping[str, int]) -> dict:
        """The forms this strategy gives the model's ops (``ParallelPlan.ops``)."""
        return {"exchange": explicit_exchange if self.dispatch == "shard_map" else None}

    def check(self, mesh_axes: Mapping[str, int], rules: Rules, workload) -> None:
        if self.dispatch == "shard_map":
            expert_axis(rules, dict(mesh_axes))  # the explicit all-to-all's layout needs


def with_dispatched_batch(rules: Rules) -> Rules:
    """Derive ``batch_no_expert``: the activation ``batch`` axes that ``expert`` does not use.

    Without an expert axis this is the whole batch layout, so a mixture-of-experts model on a
    data-parallel mesh keeps its dispatched tokens split like every other activation.
    """
    expert_axes = set(rules.activations.get("expert", ()))
    batch = rules.activations.get("batch", ())
    return rules.replace(
        activations={"batch_no_expert": tuple(a for a in batch if a not in expert_axes)}
    )


def expert_axis(rules: Rules, mesh_sizes: dict[str, int]) -> str | None:
    """The one mesh axis the activation ``expert`` dim is split over (None: not split)."""
    axes = rules.activations.get("expert", ())
    if not axes:
        return None
    if len(axes) > 1:
        raise ShardingError(
            f"shard_map dispatch: the activation rule 'expert' -> {axes} spans several mesh "
            "axes; the explicit all-to-all runs over one. Fix: map 'expert' to one axis or "
            "use dispatch=einsum."
        )
    batch = rules.activations.get("batch", ())
    if not batch or batch[-1] != axes[0]:
        raise ShardingError(
            f"shard_map dispatch: the activation 'batch' rule {batch} must end with the "
            f"expert axis {axes[0]!r} (GShard folds it into the batch, innermost) so that the "
            "all-to-all's concatenation restores contiguous groups. Fix: compose "
            "expert_parallel() after the other batch strategies, or use dispatch=einsum."
        )
    return axes[0] if mesh_sizes.get(axes[0], 1) > 1 else None


def explicit_exchange(x_GECD: jax.Array, src: tuple, dst: tuple, direction: str) -> jax.Array:
    """``ops.exchange`` as one ``jax.lax.all_to_all`` over the expert axis (dispatch=shard_map),
    so the collective is exactly this one rather than what XLA's propagation derives."""
    mesh, rules = active_layout()
    axis = expert_axis(rules, mesh_axes(mesh))
    if axis is None:  # no expert axis of size > 1: nothing to exchange
        return constrain(x_GECD, dst, what=f"moe {direction}")
    x_GECD = constrain(x_GECD, src, what=f"moe {direction} input")
    split, concat = (1, 0) if direction == "dispatch" else (0, 1)

    def all_to_all(x_local):
        return jax.lax.all_to_all(x_local, axis, split, concat, tiled=True)

    kernel = shard_map(all_to_all, mesh=mesh, in_specs=rules.spec(src), out_specs=rules.spec(dst))
    return constrain(kernel(x_GECD), dst, what=f"moe {direction} output")
