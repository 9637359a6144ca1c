"""Compose strategies into the rules for one mesh, in one visible place.

The order matters only for names two strategies both split (the activation ``batch`` dim
is split over ``data`` then ``fsdp``): outer axes first, matching the mesh's axis order.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardlib.mesh import Axis
from shardlib.rules import Rules, base_rules, compose
from shardlib.strategies import data_parallel, expert_parallel, fsdp, tensor_parallel
from shardlib.strategies.expert import with_dispatched_batch


def rules_for_mesh(mesh_axes: Mapping[str, int]) -> Rules:
    """The default plan: each mesh axis switches on the strategy of the same name."""
    parts = [base_rules()]
    if Axis.DATA in mesh_axes:
        parts.append(data_parallel(axis=Axis.DATA))
    if Axis.FSDP in mesh_axes:
        parts.append(fsdp(axis=Axis.FSDP))
    if Axis.TENSOR in mesh_axes:
        parts.append(tensor_parallel(axis=Axis.TENSOR))
    if Axis.EXPERT in mesh_axes:  # last: GShard folds the expert axis innermost into batch
        parts.append(expert_parallel(axis=Axis.EXPERT))
    rules = with_dispatched_batch(compose(*parts))
    rules.check_mesh(mesh_axes, where="plan")
    return rules
