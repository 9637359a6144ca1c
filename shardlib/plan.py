"""Compose strategies into the rules for one mesh, in one visible place.

The order matters only for names two strategies both split (the activation ``batch`` dim
is split over ``data`` then ``fsdp``): outer axes first, matching the mesh's axis order.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardlib.mesh import Axis
from shardlib.rules import Rules, base_rules, compose
from shardlib.strategies import data_parallel, fsdp, tensor_parallel
from shardlib.strategies.pipeline import pipeline_rules


def rules_for_mesh(mesh_axes: Mapping[str, int]) -> Rules:
    """The default plan: each mesh axis switches on the strategy of the same name."""
    parts = [base_rules()]
    if Axis.STAGE in mesh_axes:  # stacked layers (and staged weights) over the stage axis
        parts.append(pipeline_rules(axis=Axis.STAGE))
    if Axis.DATA in mesh_axes:
        parts.append(data_parallel(axis=Axis.DATA))
    if Axis.FSDP in mesh_axes:
        parts.append(fsdp(axis=Axis.FSDP))
    if Axis.TENSOR in mesh_axes:
        parts.append(tensor_parallel(axis=Axis.TENSOR))
    rules = compose(*parts)
    rules.check_mesh(mesh_axes, where="plan")
    return rules
