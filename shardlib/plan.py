"""Compose strategies into the rules for one mesh, in one visible place.

The order matters only for names two strategies both split (the activation ``batch`` dim
is split over ``data`` then ``fsdp``): outer axes first, matching the mesh's axis order.
"""

from __future__ import annotations

from collections.abc import Mapping

from shardlib.errors import ShardingError
from shardlib.mesh import Axis
from shardlib.rules import Rules, base_rules, compose
from shardlib.strategies import (
    context_parallel,
    data_parallel,
    expert_parallel,
    fsdp,
    tensor_2d,
    tensor_3d,
    tensor_parallel,
)
from shardlib.strategies import (
    sequence_parallel as sequence_parallel_rules,
)
from shardlib.strategies.expert import with_dispatched_batch
from shardlib.strategies.pipeline import pipeline_rules


def rules_for_mesh(mesh_axes: Mapping[str, int], *, sequence_parallel: bool = False) -> Rules:
    """The default plan: each mesh axis switches on the strategy of the same name.

    ``tensor2`` (and ``tensor3``) turn 1D tensor parallelism into the 2D (3D) rule set;
    ``sequence_parallel`` adds Megatron-SP on the ``tensor`` axis.
    """
    parts = [base_rules()]
    if Axis.STAGE in mesh_axes:  # stacked layers (and staged weights) over the stage axis
        parts.append(pipeline_rules(axis=Axis.STAGE))
    if Axis.DATA in mesh_axes:
        parts.append(data_parallel(axis=Axis.DATA))
    if Axis.FSDP in mesh_axes:
        parts.append(fsdp(axis=Axis.FSDP))
    if Axis.CONTEXT in mesh_axes:  # before tensor: res_seq splits over (context, tensor)
        parts.append(context_parallel(axis=Axis.CONTEXT))
    if Axis.TENSOR3 in mesh_axes:
        parts.append(tensor_3d())
    elif Axis.TENSOR2 in mesh_axes:
        parts.append(tensor_2d())
    elif Axis.TENSOR in mesh_axes:
        parts.append(tensor_parallel(axis=Axis.TENSOR))
    if sequence_parallel:
        _check_sequence_parallel(mesh_axes)
        parts.append(sequence_parallel_rules(axis=Axis.TENSOR))
    if Axis.EXPERT in mesh_axes:  # last: GShard folds the expert axis innermost into batch
        parts.append(expert_parallel(axis=Axis.EXPERT))
    rules = with_dispatched_batch(compose(*parts))
    rules.check_mesh(mesh_axes, where="plan")
    return rules


def _check_sequence_parallel(mesh_axes: Mapping[str, int]) -> None:
    if Axis.TENSOR not in mesh_axes:
        raise ShardingError(
            "sequence_parallel=true splits the residual stream over the tensor axis, which "
            "the mesh lacks. Fix: add a tensor axis, or set sequence_parallel=false."
        )
    if Axis.TENSOR2 in mesh_axes or Axis.TENSOR3 in mesh_axes:
        raise ShardingError(
            "sequence_parallel=true with 2D/3D tensor parallelism: both split the residual "
            "stream over the tensor axis (tokens vs width). Fix: drop one of them."
        )
