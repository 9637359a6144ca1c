"""shardlib: GSPMD-style sharding for JAX/Flax training.

Name a mesh, annotate tensors with logical axis names, pick strategies (rules from logical
names to mesh axes), and let XLA's sharding propagation complete the layout.

Everything a training loop of one's own needs is a top-level name here (``__all__``): the
mesh, the rules and the strategies that fill them, building a model on one device or in its
shards, the shardings of the batch and of optax's state, ``explain`` and ``show_sharding``.
"""

from shardlib import parallel
from shardlib.analysis import explain
from shardlib.analysis.picture import ShardingPicture, sharding_picture, show_sharding
from shardlib.analysis.report import LayoutReport, format_bytes
from shardlib.core.errors import ShardingError
from shardlib.core.layout import constrain, named_shardings, param_layout, shard_model, use_layout
from shardlib.core.mesh import (
    Axis,
    MeshSpec,
    load_mesh,
    mesh_spec,
    reference_mesh,
    simulate_cpu_devices,
)
from shardlib.core.rules import LOGICAL_NAMES, Rules, base_rules, compose, resolve_spec
from shardlib.dataset.tokens import embedded_corpus, global_batch
from shardlib.parallel import *  # noqa: F403 - every strategy's rule function (parallel.__all__)
from shardlib.parallel.plan import ParallelPlan, rules_for_mesh
from shardlib.parallel.state import (
    abstract_optimizer_state,
    abstract_params,
    batch_sharding,
    build_model,
    init_optimizer,
    optimizer_shardings,
)

__all__ = [
    *parallel.__all__,
    "LOGICAL_NAMES",
    "Axis",
    "LayoutReport",
    "MeshSpec",
    "ParallelPlan",
    "Rules",
    "ShardingError",
    "ShardingPicture",
    "abstract_optimizer_state",
    "abstract_params",
    "base_rules",
    "batch_sharding",
    "build_model",
    "compose",
    "constrain",
    "embedded_corpus",
    "explain",
    "format_bytes",
    "global_batch",
    "init_optimizer",
    "load_mesh",
    "mesh_spec",
    "named_shardings",
    "optimizer_shardings",
    "param_layout",
    "reference_mesh",
    "resolve_spec",
    "rules_for_mesh",
    "shard_model",
    "sharding_picture",
    "show_sharding",
    "simulate_cpu_devices",
    "use_layout",
]
