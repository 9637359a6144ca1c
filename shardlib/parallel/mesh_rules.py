"""``rules_for_mesh``: the rules of the default ``ParallelPlan`` on a mesh, for code that
has a mesh and no plan (a model of one's own, the planner's terms, tests).

Apart from ``plan.py`` because it only reads the plan: the plan's own checks never need it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import MeshSpec
from shardlib.core.rules import Rules
from shardlib.parallel.plan import ParallelPlan
from shardlib.parallel.tensor import TensorParallel

if TYPE_CHECKING:
    from jax.sharding import Mesh


def rules_for_mesh(
    mesh: Mesh | MeshSpec | Mapping[str, int], *, sequence_parallel: bool = False
) -> Rules:
    """The rules of the default plan on a mesh: each mesh axis switches on its strategy.

    ``mesh`` is a built ``jax.sharding.Mesh``, a ``MeshSpec`` or ``{axis: size}``. The plan
    refuses an axis no strategy declares (``ParallelPlan.known_axes``), so a typo such as
    ``tensr`` fails here instead of yielding rules that replicate everything.
    """
    if isinstance(mesh, MeshSpec):
        spec = mesh
    elif hasattr(mesh, "axis_names") and hasattr(mesh, "devices"):  # a jax Mesh
        spec = MeshSpec(tuple(zip(mesh.axis_names, mesh.devices.shape, strict=True)))
    elif isinstance(mesh, Mapping):
        spec = MeshSpec(tuple(mesh.items()))
    else:
        raise ShardingError(
            f"rules_for_mesh: got {type(mesh).__name__} {mesh!r}. Fix: pass a "
            "jax.sharding.Mesh, a shardlib.MeshSpec or a mapping {axis name: size}."
        )
    plan = ParallelPlan(mesh=spec, tensor=TensorParallel(sequence_parallel=sequence_parallel))
    if spec.fixed_size is None:  # a -1 axis: the devices of this process's backend
        import jax

        plan = plan.with_devices(jax.device_count())
    return plan.rules
