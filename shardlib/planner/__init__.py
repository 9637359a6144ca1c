"""The auto-parallel planner: choose a layout for a model and a cluster.

``Cluster`` (hardware, ``meshes/clusters/*.toml``) + ``Workload`` (model, batch, sequence)
-> ``search`` enumerates ``ParallelPlan``s (mesh axis sizes and strategy sections, built by
``candidate``), ``cost.estimate`` predicts each one's per-device memory and step time from
per-strategy terms, and the fastest plan that fits is written as a mesh preset (the plan's
own ``[mesh]`` and ``[parallel.*]`` tables) that ``shardlib train --mesh`` runs.
"""

from shardlib.core.workload import Workload
from shardlib.planner.candidate import PlanView, candidate
from shardlib.planner.cost.total import Estimate, estimate
from shardlib.planner.inputs.cluster import Cluster, load_cluster

__all__ = [
    "Cluster",
    "Estimate",
    "PlanView",
    "Workload",
    "candidate",
    "estimate",
    "load_cluster",
]
