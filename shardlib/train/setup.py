"""Bind a TrainConfig to a mesh: validated layouts, sharded initialisation, the train step.

Order of work, so that mistakes surface before anything is compiled or allocated:
1. trace the model abstractly (``nnx.eval_shape``) to get shapes and logical names;
2. run every strategy's checks (``ParallelPlan.check``) and resolve every parameter,
   optimizer-state and batch layout through the plan's rules (this is where bad meshes,
   rules and configs raise ShardingError);
3. only then build ``jit(init, out_shardings=...)`` so that no device ever holds a full copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.core.errors import ShardingError
from shardlib.core.layout import mesh_axes, named_shardings, resolve_specs, use_layout
from shardlib.core.model import (
    Inventory,
    ModelFactory,
    decoder_problem,
    inventory,
    not_a_decoder,
    resolve_model,
)
from shardlib.core.rules import Rules
from shardlib.core.workload import Workload
from shardlib.dataset.tokens import BATCH_NAMES
from shardlib.parallel import offload_stream
from shardlib.parallel import state as layouts
from shardlib.parallel.context import choice
from shardlib.parallel.context.choice import AttentionChoice
from shardlib.parallel.gradients import StepLayout
from shardlib.parallel.offload import HOST_MEMORY
from shardlib.parallel.pipeline import two_bw
from shardlib.parallel.pipeline.storage import LayerOrder, map_blocks, reorder
from shardlib.parallel.plan import ParallelPlan, suggest_presets
from shardlib.train import fp8, precision, two_bw_state
from shardlib.train.config import TrainConfig
from shardlib.train.optim import build_optimizer, freeze_base, resolve_optimizer, schedule


@dataclass(frozen=True)
class TrainSetup:
    """Everything derived from (config, mesh); built by ``make_setup``."""

    cfg: TrainConfig
    plan: ParallelPlan
    """``cfg.parallel`` with the mesh's axis sizes, the model's shapes and the settings an
    optimizer name stands for (``optim.resolve_optimizer``: onebit_adam's 1-bit momentum)."""
    model: ModelFactory
    """Builds the model (``model.make(rngs)``); ``model.config`` is its preset config."""
    inventory: Inventory
    """The model's parameters: graphdef, shapes and logical names (nothing allocated)."""
    workload: Workload
    """The model and step the plan was checked against (shapes, routing, batch, sequence)."""
    mesh: Mesh
    param_specs: dict
    tx: optax.GradientTransformation
    attention: AttentionChoice | None = None
    """The attention kernel the plan runs and why (``attention_impl=auto``'s pick)."""

    @property
    def rules(self) -> Rules:
        """Parameter and activation rules (with the ZeRO stage's parameter layout)."""
        return self.plan.state_rules.params

    @property
    def graphdef(self) -> nnx.GraphDef:
        return self.inventory.graphdef

    @property
    def param_shapes(self) -> dict:
        return self.inventory.shapes

    @property
    def param_names(self) -> dict:
        return self.inventory.names

    @property
    def model_cfg(self):
        """The model's preset config; for a plain factory, its name and keyword settings."""
        if self.model.config is not None:
            return self.model.config
        return {"factory": self.model.name, **dict(self.cfg.model_overrides)}

    @property
    def compute_dtype(self):
        return precision.compute_dtype(self.cfg.precision)

    @cached_property
    def param_shardings(self) -> dict:
        shardings = named_shardings(self.param_specs, self.mesh)
        if not self.plan.offload.params:
            return shardings
        host = jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), shardings["blocks"])
        return {
            **shardings,
            "blocks": host,
        }  # fetched one layer at a time (shardlib/parallel/layer_loop.py)

    @cached_property
    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.rules.spec(BATCH_NAMES))

    @property
    def stacked_layers(self) -> int:
        """The decoder's stacked blocks (``[layers, ...]`` under ``params["blocks"]``), which
        the streamed offload update walks; 0 for a model without them."""
        return self.workload.blocks

    @cached_property
    def _abstract_opt_state(self):
        return jax.eval_shape(self.tx.init, self.param_shapes)

    def _grad_like_shardings(self, rules: Rules) -> dict:
        specs = layouts.grad_specs(self.param_shapes, self.param_names, self.mesh, rules)
        return named_shardings(specs, self.mesh)

    @cached_property
    def grad_shardings(self) -> dict:
        """The gradient buffer's layout (ZeRO-2/3: sharded, else the parameters')."""
        return self._grad_like_shardings(self.plan.state_rules.grads)

    @cached_property
    def step_layout(self) -> StepLayout:
        """What the plan's gradient path reads of this model and its layouts."""
        return StepLayout(
            graphdef=self.graphdef,
            dtype=self.compute_dtype,
            workload=self.workload,
            mesh=self.mesh,
            param_specs=self.param_specs,
            param_shardings=self.param_shardings,
            grad_shardings=self.grad_shardings,
            batch_spec=self.batch_spec,
            batch_names=self.batch_names,
        )

    @property
    def batch_spec(self):
        """The batch's PartitionSpec as the gradient path pins micro-batches (token rows)."""
        return self.batch_sharding.spec

    batch_names = None
    """The batch arrays' logical names where they are not the decoder's token rows."""

    @cached_property
    def update_shardings(self) -> dict:
        """The layout in which gradients enter the optimizer: the optimizer state's."""
        return self._grad_like_shardings(self.plan.state_rules.opt_state)

    @cached_property
    def opt_state_shardings(self):
        """Each state tensor laid out like its parameter under the optimizer-state rules
        (factored statistics keep their remaining dims' splits); counters replicated; in
        pinned host memory with ``offload.optimizer``."""
        specs = layouts.opt_state_specs(
            self.tx,
            self._abstract_opt_state,
            self.param_shapes,
            self.mesh,
            self.plan.state_rules.opt_state,
            names=self.param_names,
        )
        if self.plan.data.onebit_momentum:  # 1-bit Adam's error buffers: one per device
            from shardlib.train.onebit import error_specs

            specs = error_specs(specs, self._abstract_opt_state)
        kind = HOST_MEMORY if self.plan.offload.optimizer else None
        return layouts.shardings(specs, self.mesh, kind)

    @cached_property
    def fp8_names(self) -> tuple[str, ...]:
        """The projections that run in FP8 (``ops.matmul``'s names in one block)."""
        return fp8.matmul_names(self.graphdef, self.param_shapes)

    def init_fp8(self) -> dict:
        """The FP8 scales and amax histories, one set per projection and stacked block."""
        layers = self.workload.blocks
        return fp8.init_meta(self.fp8_names, layers, self.cfg.precision.fp8_amax_history)

    @cached_property
    def fp8_shardings(self) -> dict | None:
        """Replicated scales and histories (None without FP8)."""
        if not fp8.enabled(self.cfg.precision):
            return None
        replicated = NamedSharding(self.mesh, P())
        return jax.tree.map(lambda _: replicated, jax.eval_shape(self.init_fp8))

    @property
    def stale_weights(self) -> bool:
        """Whether the state keeps the previous step's weights (``pipeline_schedule=2bw``
        on a stage axis: ``parallel/pipeline/two_bw.py``)."""
        return two_bw.stale(self.plan.pipeline_spec())

    @property
    def _carry_init(self):
        """2bw's ``init_carry(params, tokens)`` (``train.two_bw_state``)."""
        return two_bw_state.carry_init(self)

    @cached_property
    def carry_shapes(self) -> dict:
        """2bw's in-flight pipeline work between steps, abstractly (``two_bw_loop``)."""
        return two_bw_state.carry_shapes(self)

    @cached_property
    def carry_shardings(self) -> dict:
        """Its layout (``train.two_bw_state.carry_shardings``)."""
        return two_bw_state.carry_shardings(self)

    @cached_property
    def state_shardings(self) -> dict:
        replicated = NamedSharding(self.mesh, P())
        out = {
            "params": self.param_shardings,
            "opt_state": self.opt_state_shardings,
            "step": replicated,
        }
        if self.stale_weights:  # 2bw's W(t-1), laid out like the parameters, and its carry
            out[two_bw.PREV_PARAMS] = self.param_shardings
            out[two_bw.CARRY] = self.carry_shardings
        if precision.uses_loss_scale(self.cfg.precision):
            out["loss_scale"] = jax.tree.map(
                lambda _: replicated, precision.abstract_loss_scale(self.cfg.precision)
            )
        if self.fp8_shardings is not None:
            out[fp8.KEY] = self.fp8_shardings
        return out

    def abstract_state(self) -> dict:
        """ShapeDtypeStructs with shardings: compile (``explain``) without allocating."""
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
            self.state_shapes(),
            self.state_shardings,
        )

    def state_shapes(self) -> dict:
        """The train state's ShapeDtypeStructs (``state_shardings``' tree)."""
        shapes = {
            "params": self.param_shapes,
            "opt_state": self._abstract_opt_state,
            "step": jax.ShapeDtypeStruct((), jnp.int32),
        }
        if self.stale_weights:
            shapes[two_bw.PREV_PARAMS] = self.param_shapes
            shapes[two_bw.CARRY] = self.carry_shapes
        if precision.uses_loss_scale(self.cfg.precision):
            shapes["loss_scale"] = precision.abstract_loss_scale(self.cfg.precision)
        if fp8.enabled(self.cfg.precision):
            shapes[fp8.KEY] = jax.eval_shape(self.init_fp8)
        return shapes

    def abstract_batch(self) -> jax.ShapeDtypeStruct | dict:
        """The step's batch, abstractly: [batch, seq + 1] tokens, or for a prepared dataset
        the packed dict (``shardlib.dataset.loader``) that the step then compiles for."""
        b, s, sharding = self.cfg.dataset.batch, self.cfg.dataset.seq, self.batch_sharding
        tokens = jax.ShapeDtypeStruct((b, s + 1), jnp.int32, sharding=sharding)
        from shardlib.dataset.index import is_prepared

        if not (self.cfg.dataset.mix or is_prepared(self.cfg.dataset.path)):
            return tokens
        rows = {
            k: jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=sharding)
            for k in ("segments", "positions")
        }
        weights = jax.ShapeDtypeStruct((b, s), jnp.float32, sharding=sharding)
        return {"tokens": tokens, "weights": weights, **rows}

    @cached_property
    def _init(self):
        make, tx, prec, stale = self.model.make, self.tx, self.cfg.precision, self.stale_weights
        init_fp8 = self.init_fp8 if fp8.enabled(prec) else None

        def init(key):
            with nnx.use_eager_sharding(False):
                model = make(nnx.Rngs(params=key))
            params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            state = {
                "params": params,
                "opt_state": tx.init(params),
                "step": jnp.zeros((), jnp.int32),
            }
            if stale:  # W(-1) = W(0), and an empty pipeline
                state[two_bw.PREV_PARAMS] = jax.tree.map(jnp.copy, params)
                with use_layout(mesh, rules):
                    state[two_bw.CARRY] = init_carry(params, tokens)
            if precision.uses_loss_scale(prec):
                state["loss_scale"] = precision.init_loss_scale(prec)
            if init_fp8 is not None:
                state[fp8.KEY] = init_fp8()
            return map_blocks(order.store_rows, state, rows)  # the trainer's layer order

        order, rows = self.layer_order, self.workload.blocks
        init_carry = self._carry_init if stale else None
        mesh, rules = self.mesh, self.rules
        b, s = self.cfg.dataset.batch, self.cfg.dataset.seq
        tokens = jnp.zeros((b, s + 1), jnp.int32)
        return jax.jit(init, out_shardings=self.state_shardings)

    def init_state(self) -> dict:
        """Parameters initialised straight into their shards (jit with out_shardings), or
        read from ``checkpoint.init_from`` (parameters only; adapters stay fresh); the
        stacked rows in the trainer's ``layer_order``."""
        with jax.set_mesh(self.mesh):
            state = self._init(jax.random.key(self.cfg.run.seed))
        source = self.cfg.checkpoint.init_from
        if source:  # parameters only: the optimizer state stays fresh (all zeros)
            from shardlib.train.init_from import load_initial_params, overlay

            abstract = self.abstract_state()["params"]
            loaded = self.stored(load_initial_params(source, abstract, self.model_cfg))
            state["params"] = overlay(state["params"], loaded)
            if self.stale_weights:  # W(-1) = W(0) again, in buffers of its own (donated apart)
                state[two_bw.PREV_PARAMS] = jax.tree.map(jnp.copy, state["params"])
        return state

    @cached_property
    def layer_order(self) -> LayerOrder:
        """How the train state keeps the stacked layers' rows: stage order under an
        interleaved pipeline (no weight moves per step), else natural (``pipeline.storage``)."""
        return LayerOrder.of_spec(self.plan.pipeline_spec())

    def stored(self, tree, source: LayerOrder | None = None):
        """A state, parameters or gradients from ``source``'s layer order (default natural)
        into the trainer's."""
        return reorder(tree, source or LayerOrder(), self.layer_order, self.workload.blocks)

    def natural(self, tree):
        """Inverse of ``stored``: the trainer's rows back in the model's layer order."""
        return reorder(tree, self.layer_order, LayerOrder(), self.workload.blocks)

    @cached_property
    def schedule(self) -> optax.Schedule:
        return schedule(self.cfg.optimizer, self.cfg.run.steps)

    def schedule_of_length(self, steps: int) -> optax.Schedule:
        """This run's schedule stretched over ``steps`` (checked on resume)."""
        return schedule(dataclasses.replace(self.cfg.optimizer, schedule_steps=steps), steps)

    @cached_property
    def train_step(self):
        from shardlib.train.step import build_train_step

        return build_train_step(self)


def make_setup(cfg: TrainConfig, mesh: Mesh | None = None) -> TrainSetup:
    """Validate the config against the mesh and derive every layout (nothing is compiled).

    The plan is ``cfg.parallel``; a given ``mesh`` supplies the axis sizes (tests build
    meshes over a few of the simulated devices), otherwise the plan's mesh is built over
    every device.
    """
    if mesh is None:
        plan = cfg.parallel.with_devices(len(jax.devices()))
        mesh = plan.build_mesh()
    else:
        plan = cfg.parallel.with_mesh_axes(mesh_axes(mesh))
    model = resolve_model(cfg.model, dict(cfg.model_overrides) | cfg.lora.model_settings())
    inv = inventory(model)
    reason = decoder_problem(inv.model_type)
    if reason is not None:  # before the token data and vocabulary are asked for
        raise ShardingError(not_a_decoder(model.name, reason))
    check_positions(cfg, inv.max_positions)
    workload = Workload.from_factory(
        model,
        cfg.dataset.batch,
        cfg.dataset.seq,
        cfg.precision.compute,
        overrides=cfg.model_overrides,
        inv=inv,
        microbatches=plan.data.microbatches,
    )
    device = choice.device_of(mesh.devices.flat[0])  # the mesh's, not the default backend's
    attention = plan.attention_choice(workload, device)  # ``auto``'s pick, with its reason
    plan = plan.with_attention(attention).for_workload(workload, device)
    optimizer, plan = resolve_optimizer(cfg.optimizer, plan)  # onebit_adam: 1-bit momentum
    plan.check(workload)
    # the streamed update needs an elementwise optimizer
    offload_stream.check(plan, optimizer)
    fp8.check(cfg, plan, workload)  # the layouts FP8 training refuses
    with suggest_presets(batch=workload.micro_batch):
        specs = resolve_specs(inv.shapes, inv.names, mesh, plan.state_rules.params, "params")
    return TrainSetup(
        cfg=cfg,
        plan=plan,
        model=model,
        inventory=inv,
        workload=workload,
        mesh=mesh,
        param_specs=specs,
        tx=freeze_base(
            build_optimizer(cfg.optimizer, cfg.run.steps, plan, names=inv.names),
            cfg.lora.rank,
        ),
        attention=attention,
    )


def check_positions(cfg: TrainConfig, max_positions: int | None) -> None:
    """A training sequence longer than the positions the model covers (``max_positions``:
    its rotary tables, its position embeddings) would train on positions it was never built
    for, silently; refuse it before anything is compiled."""
    seq = cfg.dataset.seq
    if max_positions is not None and seq > max_positions:
        raise ShardingError(
            f"config: dataset.seq={seq} is longer than model {cfg.model}'s max_positions="
            f"{max_positions} (the positions it covers). Fix: seq={max_positions} or less, or "
            f"raise the model's limit (model.max_positions={seq})."
        )
