"""Train any annotated Flax NNX model through its own loss: the generic trainer.

The user gives three things: a model factory (``factory(rngs) -> nnx.Module`` whose
parameters name logical dims, ``nnx.with_partitioning``), a loss
``loss_fn(model, batch) -> (loss, metrics)`` (a scalar and a dict of scalars; a bare
scalar is taken too) and batches with the logical names of their dims (``Batches``). The
run is the decoder trainer's, piece for piece, because ``ModelSetup`` is a ``TrainSetup``
whose loss and batch are the user's:

* the plan (``ParallelPlan``: a mesh file's or one built in Python) and its rules lay out
  the parameters, the optimizer state (ZeRO stages, optimizer offload) and the batch;
* the model is traced abstractly, every layout resolved and checked, then initialised
  straight into its shards (``TrainSetup.init_state``);
* the step is ``train.step.build_step``: the plan's one gradient path with accumulation over
  ``microbatches``, the compute precision and fp16 loss scaling, donated state;
* the loop is ``train.loop.run``: checkpoints with resume and the directory lock, metrics
  writers with MFU from the compiled step's FLOPs, preemption.

A pipeline (a ``stage`` mesh axis) cuts the model's stack of blocks into stages: a model
whose ``blocks`` are one stack (``nnx.vmap``, every parameter leading with ``layers``) and
whose forward applies them with ``shardlib.run_stack`` runs GPipe, circular and 1F1B
(``train.user_pipeline``); any other model is refused on a stage axis, naming the fix.

What needs the decoder protocol (embed, stacked blocks, head, token rows) is refused before
anything is compiled, with the reason: parameter offload (it fetches the stacked blocks
one at a time), FP8 (its scales follow the blocks' projections), LoRA and the token dataset
settings. Held-out evaluation (``eval_every``) reads ``Batches.held_out`` and reports the
user's loss and metrics with the model in eval mode (``ModelSetup.eval_step``).

State besides parameters (BatchNorm statistics, a Dropout's RNG stream, counters) is carried
in the train state as ``model_state`` and written back by each step's forward pass, outside
the gradient and the optimizer (``train.user_state``).

Remat: the user's loss is one function, so the plan's ``remat`` policy is applied to the
model's layers, every module held in a list (``nnx.List``), or without one each direct
sub-module: each runs under ``nnx.remat`` with the policy, which is what remat does to
the decoder's stacked blocks.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib.core.errors import ShardingError
from shardlib.core.inventory import inventory
from shardlib.core.layout import constrain, mesh_axes, resolve_specs, use_layout
from shardlib.core.model import ModelFactory, resolve_model
from shardlib.core.workload import Workload
from shardlib.parallel.pipeline import two_bw
from shardlib.parallel.plan import suggest_presets
from shardlib.parallel.remat import RematSpec
from shardlib.train import user_state
from shardlib.train.config import TrainConfig
from shardlib.train.optim import build_optimizer, resolve_optimizer
from shardlib.train.setup import TrainSetup
from shardlib.train.user_data import Batches, _is_names
from shardlib.train.user_loss import UserLoss, remat_layers
from shardlib.train.user_pipeline import STACK, StackLoss, check_loss, check_stack


@dataclass(frozen=True)
class ModelSetup(TrainSetup):
    """A ``TrainSetup`` whose loss and batches are the user's (``make_model_setup``)."""

    loss: Callable | None = None
    """``loss_fn(model, batch) -> (loss, metrics)``."""
    data: Batches | None = None
    loss_name: str = ""
    model_state: user_state.ModelState | None = None
    """The model's state besides its parameters (``train.user_state``); None: it has none."""

    @property
    def stacked_layers(self) -> int:
        """None in the decoder's sense: a user's ``blocks`` (if any) are not one stacked
        array per weight, so optimizer offload takes the whole-state update."""
        return 0

    def trained_model(self, state: dict) -> nnx.Module:
        """The model of a train state (its parameters and model state), for inference:
        ``.eval()`` turns Dropout off and BatchNorm onto its running statistics."""
        if not self.model_state:
            return nnx.merge(self.graphdef, state["params"])
        held = state[user_state.MODEL_STATE]
        extra = (user_state.as_model_state(held, self.model_state.keys),)
        return nnx.merge(self.graphdef, state["params"], *extra)

    @cached_property
    def state_shardings(self) -> dict:
        """The decoder trainer's, plus the model state's (by its names, else replicated)."""
        out = TrainSetup.state_shardings.func(self)
        if self.model_state:
            out[user_state.MODEL_STATE] = self.model_state.shardings(self.mesh, self.rules)
        return out

    def state_shapes(self) -> dict:
        out = super().state_shapes()
        if self.model_state:
            out[user_state.MODEL_STATE] = self.model_state.shapes
        return out

    @cached_property
    def _init(self):
        """The decoder's init, plus the model state as the factory built it (seeded
        ``rngs``: ``user_state.seeded_rngs``), straight into its shardings."""
        if not self.model_state:
            return TrainSetup._init.func(self)
        make, tx, prec, keys = self.model.make, self.tx, self.cfg.precision, self.model_state.keys
        stale = self.stale_weights
        from shardlib.train import precision

        def init(key):
            with nnx.use_eager_sharding(False):
                model = make(user_state.seeded_rngs(key))
            params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
            state = {
                "params": params,
                "opt_state": tx.init(params),
                "step": jnp.zeros((), jnp.int32),
                user_state.MODEL_STATE: user_state.carried(model, keys),
            }
            if stale:  # 2bw's W(-1) = W(0) (``TrainSetup._init``)
                state[two_bw.PREV_PARAMS] = jax.tree.map(jnp.copy, params)
            if precision.uses_loss_scale(prec):
                state["loss_scale"] = precision.init_loss_scale(prec)
            return state

        return jax.jit(init, out_shardings=self.state_shardings)

    @property
    def model_cfg(self):
        out = {"factory": self.model.name, "loss": self.loss_name, "data": self.data.name}
        return out | dict(self.cfg.model_overrides)

    @cached_property
    def batch_sharding(self):
        """One NamedSharding per batch array, from the names the data declares."""
        return self.data.shardings(self.mesh, self.rules)

    @property
    def batch_spec(self):
        """The first batch array's spec (micro-batches keep each array's own names)."""
        return jax.tree.leaves(self.batch_sharding)[0].spec

    @property
    def batch_names(self):
        """The names the user's data declares, one tuple per batch array."""
        return self.data.names

    def abstract_batch(self):
        return self.data.abstract(self.batch_sharding)

    @property
    def examples_per_step(self) -> int:
        return self.data.examples

    def open_data(self) -> Batches:
        return self.data

    @cached_property
    def user_loss(self) -> UserLoss:
        if self.plan.pipeline_spec() is not None:  # the stack run by the plan's layer loop
            loss = StackLoss(
                self.graphdef, self.loss, self.compute_dtype, RematSpec(),
                masters=frozenset({STACK}),  # cast per stage (``layer_loop.master_blocks``)
                layers=self.plan.layer_loop(self.workload, self.compute_dtype),
            )  # fmt: skip
            check_loss(loss, self.param_shapes, self.abstract_batch())
            return loss
        spec = self.plan.remat.spec()
        held = (self.model_state.shapes,) if self.model_state else ()
        if spec.active and not remat_layers(
            nnx.merge(self.graphdef, self.param_shapes, *held), spec
        ):
            raise ShardingError(
                f"remat={self.plan.remat.policy}: model {self.model.name} has no layers to "
                "recompute (no nnx.List of modules, no sub-modules), and remat applies per "
                "layer. Fix: build it from sub-modules (its layers in an nnx.List), or "
                "remat=none."
            )
        keys = self.model_state.keys if self.model_state else None
        return UserLoss(self.graphdef, self.loss, self.compute_dtype, spec, keys)

    eval_perplexity = False  # the user's loss is whatever it is: no perplexity

    @cached_property
    def eval_step(self):
        """``eval(state, batch) -> (loss, examples, metrics)``: the user's loss and metrics on
        a held-out batch, the model in eval mode (no dropout, BatchNorm's running statistics)."""
        loss = dataclasses.replace(self.user_loss, training=False)
        names, held = self.data.names, bool(self.model_state)

        def eval_step(state, batch):
            with use_layout(self.mesh, self.rules):
                batch = jax.tree.map(lambda n, x: constrain(x, n), names, batch, is_leaf=_is_names)
                fn = loss.given(state[user_state.MODEL_STATE]) if held else loss
                value, metrics = fn(state["params"], batch)
            return value, jnp.float32(jax.tree.leaves(batch)[0].shape[0]), metrics

        shardings = {"params": self.param_shardings}
        if held:
            shardings[user_state.MODEL_STATE] = self.state_shardings[user_state.MODEL_STATE]
        step = jax.jit(eval_step, in_shardings=(shardings, self.batch_sharding))
        return lambda state, batch: step({k: state[k] for k in shardings}, batch)

    @cached_property
    def train_step(self):
        from shardlib.train.step import build_step

        if self.plan.data.onebit_momentum:  # 1-bit Adam / LAMB: the step in shard_map
            from shardlib.train.onebit import build_onebit_step

            return build_onebit_step(self, self.user_loss)
        names = self.data.names

        def prepare(batch):  # the batch in the layout its names give it, before anything
            return jax.tree.map(lambda n, x: constrain(x, n), names, batch, is_leaf=_is_names)

        return build_step(self, self.user_loss, prepare)


def _takes_rngs(factory: Callable) -> Callable:
    """``factory(rngs)``; a factory of no arguments (``shardlib.build_model``'s form) is
    called without them (it seeds its own ``nnx.Rngs``, so ``run.seed`` does not reach it)."""
    if isinstance(factory, type):  # a Module class: Model(rngs)
        return factory
    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: take it as factory(rngs)
        return factory
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    takes = [p for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL] + [
        p for p in params if p.kind in positional and p.default is p.empty
    ]
    return factory if takes else (lambda rngs: factory())


def _name(obj, default: str) -> str:
    return getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or default


def make_model_setup(
    cfg: TrainConfig, model, loss_fn: Callable, data: Batches, mesh=None
) -> ModelSetup:
    """Validate a user's model, loss and batches against the plan and derive every layout
    (nothing compiled): the decoder trainer's ``make_setup`` for any NNX model.

    ``model``: ``package.module:factory`` (``cfg.model``'s form, ``model.NAME`` settings
    are its keyword arguments), a ``ModelFactory``, or ``factory(rngs) -> nnx.Module``.
    """
    if mesh is None:
        plan = cfg.parallel.with_devices(len(jax.devices()))
        mesh = plan.build_mesh()
    else:
        plan = cfg.parallel.with_mesh_axes(mesh_axes(mesh))
    check_config(cfg, plan)
    if isinstance(model, str):
        factory = resolve_model(model, dict(cfg.model_overrides))
    elif isinstance(model, ModelFactory):
        factory = model
    else:
        factory = ModelFactory(_name(model, "model"), None, _takes_rngs(model), None)
    held = None
    try:
        inv = inventory(factory, stacked=False)
    except ValueError as err:  # nnx.split: variables besides nnx.Param
        if "Non-exhaustive filters" not in str(err):
            raise
        inv, held = user_state.user_inventory(factory)  # carried in the train state
    check_stack(factory.name, inv, plan, held)  # a stage axis: the stack a pipeline cuts
    batch = data.examples
    if batch % plan.data.microbatches:
        raise ShardingError(
            f"data {data.name}: a batch of {batch} examples does not split into "
            f"microbatches={plan.data.microbatches}. Fix: a batch that divides by it."
        )
    workload = Workload.from_factory(
        factory, batch, 1, cfg.precision.compute, inv=inv, microbatches=plan.data.microbatches
    )
    _, plan = resolve_optimizer(cfg.optimizer, plan)
    if held and plan.data.onebit_momentum:
        raise ShardingError(
            f"model {factory.name} holds state besides its parameters ("
            f"{', '.join(held.where[:3])}), which 1-bit Adam/LAMB's per-device step does not "
            "carry (its forward sees one device's batch). Fix: optimizer=adamw (or lamb)."
        )
    with suggest_presets(batch=batch // plan.data.microbatches):
        specs = resolve_specs(inv.shapes, inv.names, mesh, plan.state_rules.params, "params")
    cfg = dataclasses.replace(cfg, model=factory.name)
    setup = ModelSetup(
        cfg=cfg,
        plan=plan,
        model=factory,
        inventory=inv,
        workload=workload,
        mesh=mesh,
        param_specs=specs,
        tx=build_optimizer(cfg.optimizer, cfg.run.steps, plan),
        loss=loss_fn,
        data=data,
        loss_name=_name(loss_fn, "loss_fn"),
        model_state=held,
    )
    setup.batch_sharding  # noqa: B018 (every batch array checked against the mesh now)
    setup.user_loss  # noqa: B018 (remat's layers found now)
    return setup


def check_config(cfg: TrainConfig, plan) -> None:
    """Refuse, with the reason, what only the decoder protocol or token data can do."""
    data = cfg.dataset
    refusals = []
    if plan.offload.params:
        refusals.append(
            "offload.params: it fetches the stacked blocks from host memory one layer at a "
            "time inside the decoder's layer loop. Fix: offload.optimizer, or zero=3"
        )
    if cfg.precision.compute == "fp8":
        refusals.append(
            "precision=fp8: its scales follow the decoder blocks' projections. Fix: bf16"
        )
    if cfg.lora.rank:
        refusals.append(
            "lora.rank: adapters are built on the decoder's projections. Fix: lora.rank=0"
        )
    if data.path or data.mix:
        refusals.append(
            "dataset.path / mix: token data for decoders; a model of your own reads its batches "
            "from data= (held-out ones from Batches(..., held_out=...)). Fix: leave them unset"
        )
    if plan.loss.chunk:
        refusals.append("loss.chunk: it slices the decoder head's vocabulary loss. Fix: chunk=0")
    if refusals:
        raise ShardingError(
            f"model {cfg.model} trained through its own loss cannot use "
            + "; ".join(refusals)
            + "."
        )


def user_config(plan=None, **settings) -> TrainConfig:
    """A run's config: ``plan`` (a ``ParallelPlan``, a mesh file or preset name, or None:
    the default plan) with ``settings`` in the CLI's forms (``steps=20``, ``zero=3``,
    ``checkpoint_dir=...``; ``checkpoint__every=5`` for a dotted name)."""
    from shardlib.core.mesh import load_mesh
    from shardlib.core.values import flatten_table
    from shardlib.parallel.plan import ParallelPlan
    from shardlib.train.config import override

    base = TrainConfig()
    if isinstance(plan, str):
        spec = load_mesh(plan)
        base = override(
            TrainConfig(parallel=ParallelPlan.from_mesh_spec(spec)), flatten_table(spec.train)
        )
    elif plan is not None:
        base = TrainConfig(parallel=plan)
    return override(base, {k.replace("__", "."): v for k, v in settings.items()})


def train_model(
    model,
    loss_fn: Callable,
    data,
    *,
    names=None,
    plan=None,
    mesh=None,
    state: dict | None = None,
    stop_after: int | None = None,
    show: bool = False,
    console=None,
    **settings,
):
    """Train ``model`` (``factory(rngs)``, ``pkg.mod:factory`` or a ``ModelFactory``) on
    ``data`` (``Batches``, or a source with ``names``) by ``loss_fn(model, batch) ->
    (loss, metrics)``, as ``shardlib train`` would: the plan from ``plan`` (module
    docstring; ``user_config``) on ``mesh`` (default: the plan's, over every device).
    Returns the loop's ``RunResult`` (``losses``, ``records``, ``state``, ``checkpoint``);
    ``stop_after=k`` stops at step ``k`` with a checkpoint, as a preemption would."""
    from shardlib.train.loop import run
    from shardlib.train.user_data import as_batches

    cfg = user_config(plan, **settings)
    batches = as_batches(data, names, _name(data, "batches"))
    setup = make_model_setup(cfg, model, loss_fn, batches, mesh)
    return run(setup, state=state, show=show, console=console, stop_after=stop_after)
