"""Training with the optimizer state on NVMe (``offload.nvme_path``): a jitted gradient step,
then the update streamed layer by layer from the files (``parallel.offload_nvme``).

The gradient is the trainer's (``decoder_loss.make_loss_fn`` through the plan's ``grad_function``:
the same loss, layer loop and micro-batches as ``build_train_step``); only the update
leaves the compiled program, since its state is read from and written to files between
the layers' device calls. ``NvmeTrainStep`` puts the two behind JAX's ahead-of-time
interface (``lower(state, batch).compile()``, then calls), so ``train.loop.run`` drives it
like any other step: ``TrainSetup.train_step`` is one when ``nvme_path`` is set.

In the loop the state's ``opt_state`` is the ``NvmeOptimizerState`` (the files); a
checkpoint saves ``saved_form`` of it, optax's own pytree read from the files, so the saved
step has the same tensors as an in-memory run's and either kind of run resumes the other's
(``live_form`` writes a restored state back into files).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from shardlib.core.errors import ShardingError
from shardlib.core.layout import constrain, use_layout
from shardlib.dataset.tokens import BATCH_NAMES
from shardlib.parallel.offload import HOST_MEMORY
from shardlib.parallel.offload_grads import (
    BLOCKS,
    plan_sends_grads_to_host,
    step_sends_grads_to_host,
)
from shardlib.parallel.offload_nvme import NvmeOptimizerState
from shardlib.parallel.offload_nvme_params import NvmeParams, reading
from shardlib.train import fp8, precision
from shardlib.train.step import grad_function, make_loss_fn, normalise_weights

if TYPE_CHECKING:
    from shardlib.train.setup import TrainSetup


def check(setup: TrainSetup) -> None:
    """The NVMe tier keeps each state tensor whole in one file (no ZeRO split of the state),
    and its step is the plain one: no fp16 loss scaling, no FP8 scales to carry."""
    if precision.uses_loss_scale(setup.cfg.precision) or fp8.enabled(setup.cfg.precision):
        raise ShardingError(
            f"offload.nvme_path with precision.compute={setup.cfg.precision.compute}: the NVMe "
            "step carries no fp16 loss scale and no FP8 scales. Fix: precision=bf16 or fp32, "
            "or drop nvme_path (offload_optimizer streams the state from host memory)."
        )
    if setup.stacked_layers == 0:
        raise ShardingError(
            "offload.nvme_path streams the optimizer state one stacked layer at a time, but "
            "this model has no stacked blocks (params['blocks']). Fix: drop nvme_path "
            "(offload_optimizer keeps the state in host memory and updates it whole)."
        )
    if jax.process_count() > 1:
        raise ShardingError(
            f"offload.nvme_path with {jax.process_count()} processes: each would keep the whole "
            "state in its own files and the checkpoint would save one copy; only one process "
            "is supported. Fix: one process (one host), or offload_optimizer without nvme_path."
        )
    if setup.plan.offload.nvme_params and not plan_sends_grads_to_host(setup.plan):
        raise ShardingError(
            "offload.nvme_params: the layer loop reads the weights from files and sends "
            "their gradients to host memory in the backward, which this plan does not "
            "(offload_grads=false, micro-batches, ZeRO++ or 1-bit Adam). Fix: "
            "offload_grads=true and microbatches=1, or drop nvme_params."
        )
    if setup.plan.offload.nvme_params and setup.cfg.dataset.eval_every:
        raise ShardingError(
            f"offload.nvme_params with dataset.eval_every={setup.cfg.dataset.eval_every}: "
            "the evaluation step takes the weights as arrays, not files. Fix: eval_every=0, "
            "or drop nvme_params."
        )
    if setup.plan.data.zero or setup.plan.offload.params or setup.plan.pipeline_spec():
        raise ShardingError(
            "offload.nvme_path keeps every optimizer-state tensor whole in one file, but this "
            f"plan splits or moves it (zero={setup.plan.data.zero}, offload.params="
            f"{setup.plan.offload.params}, pipeline={setup.plan.pipeline_spec() is not None}). "
            "Fix: zero=0 without offload_params or a stage axis, or drop nvme_path "
            "(offload_optimizer keeps the state in host memory)."
        )


def nvme_state(setup: TrainSetup, params: dict, directory=None) -> NvmeOptimizerState:
    """The state's files under ``offload.nvme_path``: fresh (``tx.init``) or, with
    ``directory``, restored from a checkpoint's copy."""
    check(setup)
    path, kw = setup.plan.offload.nvme_path, {"clip_norm": setup.cfg.optimizer.clip_norm}
    if directory is None:
        return NvmeOptimizerState.create(setup.tx, params, path, setup.mesh, **kw)
    return NvmeOptimizerState.restore(setup.tx, params, path, setup.mesh, directory, **kw)


def nvme_weights(setup: TrainSetup, blocks) -> NvmeParams:
    """The stacked weights ``blocks`` written into files under ``offload.nvme_path``."""
    check(setup)
    return NvmeParams.create(blocks, setup.plan.offload.nvme_path)


def _loss_and_grads(setup: TrainSetup):
    """``(params, batch) -> (loss, metrics, grads)``, jitted: the trainer's gradient path."""
    loss_fn = make_loss_fn(setup, with_metrics=True, lora=True)

    def loss_and_grads(params, tokens_BL1):
        with use_layout(setup.mesh, setup.rules):
            tokens_BL1 = jax.tree.map(lambda x: constrain(x, BATCH_NAMES), tokens_BL1)
            grad_fn = grad_function(setup, loss_fn, has_aux=True, stored=True)
            (loss, metrics), grads = grad_fn(params, normalise_weights(tokens_BL1))
        return loss, dict(metrics), grads

    return jax.jit(loss_and_grads, in_shardings=(setup.param_shardings, setup.batch_sharding))


def build_nvme_step(setup: TrainSetup, state: NvmeOptimizerState):
    """``step(params, batch) -> (params, metrics)``: gradients on the device, then the
    update through ``state``'s files."""
    grads_of = _loss_and_grads(setup)

    def step(params, batch):
        loss, _, grads = grads_of(params, batch)
        params, norm = state.update(grads, params)
        return params, {"loss": loss, "grad_norm": norm}

    return step


def _grads_from_files(setup: TrainSetup, weights: NvmeParams):
    """``(rest, batch) -> (loss, metrics, grads)``, jitted: the trainer's gradient path with
    the stacked weights read from ``weights``'s files layer by layer (``layer_loop``), their
    gradients in host memory. ``rest``: the parameters but ``blocks``."""
    if not step_sends_grads_to_host(setup.plan, setup.stacked_layers):
        raise ShardingError(
            "the stacked weights in files are read by the layer loop, whose gradients must "
            "leave for host memory in the backward (offload_grads), but this plan keeps them "
            "on the device. Fix: offload_optimizer=true with offload_grads=true, one "
            "micro-batch, no pipeline, ZeRO++ or 1-bit Adam."
        )
    loss_fn = make_loss_fn(setup, with_metrics=True, lora=True)
    rest_shardings = {k: v for k, v in setup.param_shardings.items() if k != BLOCKS}
    hosts = jax.tree.map(lambda s: s.with_memory_kind(HOST_MEMORY), setup.param_shardings[BLOCKS])
    shapes = jax.tree.unflatten(weights.treedef, weights.leaves)

    def loss_and_grads(rest, tokens_BL1):
        # stand-ins for the weights: the model's tree needs them, nothing reads their values
        blocks = jax.tree.map(lambda x, h: jax.device_put(jnp.zeros(x.shape, x.dtype), h),
                              shapes, hosts)  # fmt: skip
        with use_layout(setup.mesh, setup.rules), reading(weights):
            tokens_BL1 = jax.tree.map(lambda x: constrain(x, BATCH_NAMES), tokens_BL1)
            grad_fn = grad_function(setup, loss_fn, has_aux=True, stored=True)
            (loss, metrics), grads = grad_fn(
                {**rest, BLOCKS: blocks}, normalise_weights(tokens_BL1)
            )
        return loss, dict(metrics), grads

    return jax.jit(loss_and_grads, in_shardings=(rest_shardings, setup.batch_sharding))


def build_nvme_params_step(setup: TrainSetup, state: NvmeOptimizerState, weights: NvmeParams):
    """``step(rest, batch) -> (rest, metrics)``: the stacked weights and the optimizer state
    in files (ZeRO-Infinity's ``offload_param`` and ``offload_optimizer`` on NVMe); ``rest``
    the parameters but ``blocks``, on the device."""
    grads_of = _grads_from_files(setup, weights)

    def step(rest, batch):
        loss, _, grads = grads_of(rest, batch)
        rest, norm = state.update_files(grads, rest, weights)
        return rest, {"loss": loss, "grad_norm": norm}

    return step


class NvmeTrainStep:
    """The NVMe run's train step, ``step(state, batch) -> (state, metrics)`` as
    ``build_train_step``'s, with ``state["opt_state"]`` the files (``nvme_state``) and, with
    ``offload.nvme_params``, ``state["params"]["blocks"]`` too (``nvme_weights``).

    ``lower(state, batch).compile()`` compiles the gradient program ahead of time, as the
    loop does for a jitted step; the compiled step's analyses are that program's (the
    update's per-layer calls are small and hold one layer's state: ``offload_nvme``). The
    program reading weights from files reads the files of the state it was built for."""

    def __init__(self, setup: TrainSetup, grads=None, weights: NvmeParams | None = None) -> None:
        check(setup)
        self.setup, self._grads, self._weights = setup, grads, weights

    def _program(self, state: dict):
        blocks = state["params"].get(BLOCKS)
        if self._grads is None:  # built for the first state it sees: weights in files or not
            in_files = isinstance(blocks, NvmeParams)
            self._weights = blocks if in_files else None
            self._grads = _grads_from_files(self.setup, blocks) if in_files else (
                _loss_and_grads(self.setup))  # fmt: skip
        if self._weights is not None and blocks is not self._weights:
            raise ShardingError(
                "NvmeTrainStep: this state's params['blocks'] are not the files the step "
                "was compiled to read. Fix: NvmeParams.load(directory) into the same "
                "store, or compile the step again for this state."
            )
        return self._grads

    def _inputs(self, params: dict) -> dict:
        """What the gradient program takes: the parameters, less the weights in files."""
        if self._weights is None:
            return params
        return {k: v for k, v in params.items() if k != BLOCKS}

    def lower(self, state: dict, batch) -> _Lowered:
        lowered = self._program(state).lower(self._inputs(state["params"]), batch)
        return _Lowered(self.setup, lowered, self._weights)

    def __call__(self, state: dict, batch) -> tuple[dict, dict]:
        loss, metrics, grads = self._program(state)(self._inputs(state["params"]), batch)
        files: NvmeOptimizerState = state["opt_state"]
        if self._weights is None:
            params, norm = files.update(grads, state["params"])
        else:
            rest, norm = files.update_files(grads, self._inputs(state["params"]), self._weights)
            params = {**rest, BLOCKS: self._weights}
        metrics = {
            "loss": loss,
            "grad_norm": norm,
            "lr": self.setup.schedule(state["step"]),
            **metrics,
        }
        return {"params": params, "opt_state": files, "step": state["step"] + 1}, metrics

    def __getattr__(self, name: str):
        """A compiled step's ``as_text``, ``cost_analysis``, ``memory_analysis``...: its
        gradient program's (what the loop's MFU and memory records read)."""
        if name.startswith("_") or self._grads is None:
            raise AttributeError(name)
        return getattr(self._grads, name)


class _Lowered:
    def __init__(self, setup: TrainSetup, lowered, weights) -> None:
        self.setup, self.lowered, self.weights = setup, lowered, weights

    def compile(self) -> NvmeTrainStep:
        return NvmeTrainStep(self.setup, grads=self.lowered.compile(), weights=self.weights)


def saved_form(state: dict) -> dict:
    """What a checkpoint saves of an NVMe run's state: optax's pytree and the parameters,
    read from the files."""
    files, blocks = state["opt_state"], state["params"].get(BLOCKS)
    if isinstance(blocks, NvmeParams):
        state = {**state, "params": {**state["params"], BLOCKS: blocks.tree()}}
    if not isinstance(files, NvmeOptimizerState):
        return state
    return {**state, "opt_state": files.tree()}


def live_form(setup: TrainSetup, state: dict) -> dict:
    """A restored state (optax's pytree in host memory) with its optimizer state written
    into fresh files under ``offload.nvme_path``, and with ``offload.nvme_params`` its
    stacked weights."""
    if not isinstance(state["opt_state"], NvmeOptimizerState):
        check(setup)
        files = NvmeOptimizerState.from_tree(
            setup.tx,
            state["params"],
            setup.plan.offload.nvme_path,
            setup.mesh,
            state["opt_state"],
            clip_norm=setup.cfg.optimizer.clip_norm,
        )
        state = {**state, "opt_state": files}
    blocks = state["params"][BLOCKS]
    if setup.plan.offload.nvme_params and not isinstance(blocks, NvmeParams):
        state = {**state, "params": {**state["params"], BLOCKS: nvme_weights(setup, blocks)}}
    return state
