"""shardlib: GSPMD-style sharding for JAX/Flax training.

Name a mesh, annotate tensors with logical axis names, pick strategies (rules from logical
names to mesh axes), and let XLA's sharding propagation complete the layout.
"""

from shardlib.errors import ShardingError

# Imported eagerly so that the name ``shardlib.explain`` is the function: importing the
# submodule later must not rebind the package attribute to the module.
from shardlib.explain import explain
from shardlib.layout import constrain, param_layout, shard_model, use_layout
from shardlib.mesh import Axis, MeshSpec, load_mesh, mesh_spec, simulate_cpu_devices
from shardlib.parallel import ParallelPlan, rules_for_mesh
from shardlib.picture import ShardingPicture, sharding_picture, show_sharding
from shardlib.rules import Rules, base_rules, compose, resolve_spec

__all__ = [
    "Axis",
    "MeshSpec",
    "ParallelPlan",
    "Rules",
    "ShardingError",
    "ShardingPicture",
    "base_rules",
    "compose",
    "constrain",
    "explain",
    "load_mesh",
    "mesh_spec",
    "param_layout",
    "resolve_spec",
    "rules_for_mesh",
    "shard_model",
    "sharding_picture",
    "show_sharding",
    "simulate_cpu_devices",
    "use_layout",
]
