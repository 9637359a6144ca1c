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

from shardlib.core.errors import ShardingError
from shardlib.core.inventory import Inventory, inventory
from shardlib.core.layout import mesh_axes, named_shardings, resolve_specs, use_layout
from shardlib.core.model import ModelFactory, decoder_problem, not_a_decoder, resolve_model
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
from shardlib.train import fp8, precision
from shardlib.train.config import TrainConfig
from shardlib.train.optim import build_optimizer, freeze_base, resolve_optimizer, schedule
from shardlib.train.state_layout import StateLayout


@dataclass(frozen=True)
class TrainSetup(StateLayout):
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
            stacked_layers=self.stacked_layers,
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

        # the NVMe tier writes its state into files layer by layer (``train.nvme``): the
        # compiled initialisation leaves it out, so it is never whole in memory
        in_files = bool(self.plan.offload.nvme_path)

        def init(key):
            with nnx.use_eager_sharding(False):
                model = make(nnx.Rngs(params=key))
            params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            state = {"params": params, "step": jnp.zeros((), jnp.int32)}
            if not in_files:
                state["opt_state"] = tx.init(params)
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
        shardings = dict(self.state_shardings)
        if in_files:
            del shardings["opt_state"]
        return jax.jit(init, out_shardings=shardings)

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
        if self.plan.offload.nvme_path:  # fresh files, tx.init written one layer at a time
            from shardlib.train.nvme import nvme_state

            state["opt_state"] = nvme_state(self, state["params"])
            if self.plan.offload.nvme_params:  # and the stacked weights, layer by layer
                from shardlib.train.nvme import nvme_weights

                blocks = nvme_weights(self, state["params"]["blocks"])
                state["params"] = {**state["params"], "blocks": blocks}
        return state

    def saved_form(self, state: dict) -> dict:
        """What a checkpoint saves of ``state`` (the NVMe tier's: read from its files)."""
        from shardlib.train.nvme import saved_form

        return saved_form(state) if self.plan.offload.nvme_path else state

    def live_form(self, state: dict) -> dict:
        """A restored state as the step takes it (the NVMe tier's: written into files)."""
        from shardlib.train.nvme import live_form

        return live_form(self, state) if self.plan.offload.nvme_path else state

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
        if self.plan.offload.nvme_path:  # the update runs between device calls
            from shardlib.train.nvme import NvmeTrainStep

            return NvmeTrainStep(self)
        from shardlib.train.step import build_train_step

        return build_train_step(self)

    def with_exp_avg_mask(self, exp_avg_mask) -> TrainSetup:
        """This setup with DeepSpeed's ``exp_avg_mask`` for 1-bit Adam / LAMB (a tree like
        the parameters, each leaf broadcastable to its parameter; ``onebit.apply_exp_avg_mask``):
        a tensor, so set from Python as DeepSpeed sets it in a parameter group, not from a
        config file. Checked against the parameters before anything is compiled."""
        from shardlib.train.onebit import check_exp_avg_mask

        check_exp_avg_mask(exp_avg_mask, self.param_shapes)
        cfg = self.cfg
        tx = build_optimizer(
            cfg.optimizer, cfg.run.steps, self.plan, self.param_names, exp_avg_mask
        )
        return dataclasses.replace(self, tx=freeze_base(tx, cfg.lora.rank))

    eval_perplexity = True
    """Whether the held-out loss is a per-token cross-entropy (perplexity is its exp)."""

    @cached_property
    def eval_step(self):
        """``eval(state, batch) -> (loss, weight, metrics)`` on one held-out batch, combined
        over batches as a mean weighted by ``weight`` (``train.loop.Evaluation``)."""
        from shardlib.train.step import build_eval_step

        step = build_eval_step(self)
        return lambda state, batch: (*step(fp8.eval_params(state), batch), {})


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
