"""Bind a TrainConfig to a mesh: validated layouts, sharded initialisation, the train step.

Order of work, so that mistakes surface before anything is compiled or allocated:
1. trace the model abstractly (``nnx.eval_shape``) to get shapes and logical names;
2. resolve every parameter, optimizer-state and batch layout through the rules (this is
   where bad meshes, rules and configs raise ShardingError);
3. only then build ``jit(init, out_shardings=...)`` so that no device ever holds a full copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import models
from shardlib.attention import AttentionPlan
from shardlib.layout import abstract_state, mesh_axes, named_shardings, resolve_specs
from shardlib.plan import rules_for_mesh
from shardlib.rules import Rules, resolve_spec
from shardlib.strategies.context import attention_plan
from shardlib.strategies.zero import StateRules, zero
from shardlib.train import layouts, precision
from shardlib.train.config import TrainConfig, apply_overrides
from shardlib.train.optim import build_optimizer, schedule

BATCH_NAMES = ("batch", None)  # tokens [batch, seq + 1]: positions are never split on input


@dataclass(frozen=True)
class TrainSetup:
    """Everything derived from (config, mesh, rules); built by ``make_setup``."""

    cfg: TrainConfig
    model_cfg: Any
    mesh: Mesh
    rules: Rules
    graphdef: nnx.GraphDef
    param_shapes: dict
    param_specs: dict
    tx: optax.GradientTransformation
    # --- issue 3: per-role layouts (ZeRO), offload, loss scaling ---
    param_names: dict | None = None
    """Logical names of every parameter (for gradient and optimizer-state layouts)."""
    state_rules: StateRules | None = None
    """Rules per state role (ZeRO stage); None: everything follows ``rules``."""
    attention: AttentionPlan = AttentionPlan()
    """How the model's attention runs on this mesh (issue 4: context parallel, chunked)."""

    @property
    def compute_dtype(self):
        return precision.compute_dtype(self.cfg)

    @cached_property
    def param_shardings(self) -> dict:
        from shardlib.train import staging  # issue 6: pinned_host blocks with offload_params

        return staging.param_shardings(named_shardings(self.param_specs, self.mesh), self.cfg)

    @cached_property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.rules.spec(BATCH_NAMES))

    @cached_property
    def _abstract_opt_state(self):
        return jax.eval_shape(self.tx.init, self.param_shapes)

    @cached_property
    def _roles(self) -> StateRules:
        rules = self.rules
        return self.state_rules or StateRules(params=rules, grads=rules, opt_state=rules)

    @cached_property
    def grad_shardings(self) -> dict:
        """The gradient buffer's layout (ZeRO-2/3: sharded, else the parameters')."""
        specs = layouts.grad_specs(
            self.param_shapes, self.param_names, self.mesh, self._roles.grads
        )
        return named_shardings(specs, self.mesh)

    @cached_property
    def update_shardings(self) -> dict:
        """The layout in which gradients enter the optimizer: the optimizer state's."""
        specs = layouts.grad_specs(
            self.param_shapes, self.param_names, self.mesh, self._roles.opt_state
        )
        return named_shardings(specs, self.mesh)

    @cached_property
    def opt_state_shardings(self):
        """Each state tensor laid out like its parameter under the optimizer-state rules
        (factored statistics keep their remaining dims' splits); counters replicated; in
        pinned host memory with ``offload_optimizer``."""
        specs = layouts.opt_state_specs(
            self.tx,
            self._abstract_opt_state,
            self.param_shapes,
            self.param_names,
            self.mesh,
            self._roles.opt_state,
        )
        kind = layouts.HOST_MEMORY if self.cfg.offload_optimizer else None
        return layouts.shardings(specs, self.mesh, kind)

    @cached_property
    def state_shardings(self) -> dict:
        replicated = NamedSharding(self.mesh, P())
        out = {
            "params": self.param_shardings,
            "opt_state": self.opt_state_shardings,
            "step": replicated,
        }
        if precision.uses_loss_scale(self.cfg):
            out["loss_scale"] = jax.tree.map(
                lambda _: replicated, precision.abstract_loss_scale(self.cfg)
            )
        return out

    def abstract_state(self) -> dict:
        """ShapeDtypeStructs with shardings: compile (``explain``) without allocating."""
        shapes = {
            "params": self.param_shapes,
            "opt_state": self._abstract_opt_state,
            "step": jax.ShapeDtypeStruct((), jnp.int32),
        }
        if precision.uses_loss_scale(self.cfg):
            shapes["loss_scale"] = precision.abstract_loss_scale(self.cfg)
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            shapes,
            self.state_shardings,
        )

    def abstract_batch(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(
            (self.cfg.batch, self.cfg.seq + 1), jnp.int32, sharding=self.batch_sharding
        )

    @cached_property
    def _init(self):
        model_cfg, tx, cfg = self.model_cfg, self.tx, self.cfg

        def init(key):
            with nnx.use_eager_sharding(False):
                model = models.build(model_cfg, nnx.Rngs(params=key))
            params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            state = {
                "params": params,
                "opt_state": tx.init(params),
                "step": jnp.zeros((), jnp.int32),
            }
            if precision.uses_loss_scale(cfg):
                state["loss_scale"] = precision.init_loss_scale(cfg)
            return state

        return jax.jit(init, out_shardings=self.state_shardings)

    def init_state(self) -> dict:
        """Parameters initialised straight into their shards (jit with out_shardings)."""
        with jax.set_mesh(self.mesh):
            return self._init(jax.random.key(self.cfg.seed))

    @cached_property
    def schedule(self) -> optax.Schedule:
        return schedule(self.cfg)

    @cached_property
    def train_step(self):
        from shardlib.train.step import build_train_step

        return build_train_step(self)


def make_setup(cfg: TrainConfig, mesh: Mesh, rules: Rules | None = None) -> TrainSetup:
    """Validate the config against the mesh and derive every layout (nothing is compiled)."""
    model_cfg = apply_overrides(
        models.config(cfg.model), dict(cfg.model_overrides), f"model {cfg.model}"
    )
    axes = mesh_axes(mesh)
    if rules is None:
        rules = rules_for_mesh(axes, sequence_parallel=cfg.sequence_parallel)
    rules.check_mesh(axes)
    roles = zero(rules, stage=cfg.zero, mesh_axes=axes)  # issue 3: ZeRO stage per state role
    rules = roles.params
    graphdef, shapes, names = abstract_state(lambda: models.build(model_cfg, nnx.Rngs(0)))
    specs = resolve_specs(shapes, names, mesh, rules, "params")
    resolve_spec(
        f"batch (one micro-batch of {cfg.microbatch} sequences)",
        (cfg.microbatch, cfg.seq + 1),
        BATCH_NAMES,
        rules,
        axes,
        "activations",
    )
    resolve_spec(
        "activations [batch, seq, embed]",
        (cfg.microbatch, cfg.seq, 1),
        ("batch", "seq", None),
        rules,
        axes,
        "activations",
    )
    from shardlib.train import staging  # issue 6: remat, pipeline and offload settings

    staging.check(cfg, model_cfg, mesh, rules)
    return TrainSetup(
        cfg=cfg,
        model_cfg=model_cfg,
        mesh=mesh,
        rules=rules,
        graphdef=graphdef,
        param_shapes=shapes,
        param_specs=specs,
        tx=build_optimizer(cfg),
        param_names=names,
        state_rules=roles,
        attention=attention_plan(cfg, axes, rules, model_cfg),
    )
