"""shardlib: GSPMD-style sharding for JAX/Flax training.

Name a mesh, annotate tensors with logical axis names, pick strategies (rules from logical
names to mesh axes), and let XLA's sharding propagation complete the layout.

Everything a training loop of one's own needs is a top-level name here (``__all__``): the
mesh, the rules and the strategies that fill them, building a model on one device or in its
shards, the shardings of the batch and of optax's state, ``explain`` and ``show_sharding``.

The names load on first use (PEP 562 ``__getattr__``): ``import shardlib`` itself imports
nothing heavy, so the command line can take SIGTERM/SIGINT before JAX starts
(``shardlib.tools.entry``).
"""

from __future__ import annotations

import importlib
import importlib.util

_FROM = {
    "shardlib.analysis": ("explain",),
    "shardlib.analysis.picture": ("ShardingPicture", "sharding_picture", "show_sharding"),
    "shardlib.analysis.report": ("LayoutReport", "format_bytes"),
    "shardlib.core.errors": ("ShardingError",),
    "shardlib.core.layout": (
        "constrain", "named_shardings", "param_layout", "shard_model", "use_layout",
    ),
    "shardlib.core.mesh": (
        "Axis", "MeshSpec", "load_mesh", "mesh_spec", "reference_mesh", "simulate_cpu_devices",
    ),
    "shardlib.core.rules": ("LOGICAL_NAMES", "Rules", "base_rules", "compose"),
    "shardlib.core.resolve": ("resolve_spec",),
    "shardlib.core.stack": ("run_stack",),
    "shardlib.dataset.tokens": ("embedded_corpus", "global_batch"),
    "shardlib.parallel": (  # every strategy's rule function (``parallel.__all__``)
        "context_parallel", "data_parallel", "expert_parallel", "fsdp", "sequence_parallel",
        "tensor_2d", "tensor_3d", "tensor_parallel",
    ),
    "shardlib.parallel.mesh_rules": ("rules_for_mesh",),
    "shardlib.parallel.plan": ("ParallelPlan",),
    "shardlib.train.user_data": ("Batches",),
    "shardlib.train.user_model": ("ModelSetup", "make_model_setup", "train_model", "user_config"),
    "shardlib.parallel.state": (
        "abstract_optimizer_state", "abstract_params", "batch_sharding", "build_model",
        "init_optimizer", "optimizer_shardings",
    ),
}  # fmt: skip
_WHERE = {name: module for module, names in _FROM.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    """A top-level name, imported from its module the first time it is asked for."""
    module = _WHERE.get(name)
    if module is None:  # a subpackage (``shardlib.parallel``), as an eager import made it
        if importlib.util.find_spec(f"shardlib.{name}") is None:
            raise AttributeError(f"module 'shardlib' has no attribute {name!r}")
        return importlib.import_module(f"shardlib.{name}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
