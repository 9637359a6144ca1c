"""Training with the optimizer state on NVMe (``offload.nvme_path``): a jitted gradient step,
then the update streamed layer by layer from the files (``parallel.offload_nvme``).

The gradient is the trainer's (``step.make_loss_fn`` through the plan's ``grad_function``:
the same loss, layer loop and micro-batches as ``build_train_step``); only the update
leaves the compiled program, since its state is read from and written to files between
the layers' device calls. The trainer's own loop (``train.loop.run``) does not drive this
step yet: ``build_train_step`` refuses ``nvme_path`` and names this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from shardlib.core.errors import ShardingError
from shardlib.core.layout import constrain, use_layout
from shardlib.dataset.tokens import BATCH_NAMES
from shardlib.parallel.offload_nvme import NvmeOptimizerState
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


def build_nvme_step(setup: TrainSetup, state: NvmeOptimizerState):
    """``step(params, batch) -> (params, metrics)``: gradients on the device, then the
    update through ``state``'s files."""
    loss_fn = make_loss_fn(setup, with_metrics=True, lora=True)

    def loss_and_grads(params, tokens_BL1):
        with use_layout(setup.mesh, setup.rules):
            tokens_BL1 = jax.tree.map(lambda x: constrain(x, BATCH_NAMES), tokens_BL1)
            grad_fn = grad_function(setup, loss_fn, has_aux=True, stored=True)
            (loss, _), grads = grad_fn(params, normalise_weights(tokens_BL1))
        return loss, grads

    grads_of = jax.jit(loss_and_grads, in_shardings=(setup.param_shardings, setup.batch_sharding))

    def step(params, batch):
        loss, grads = grads_of(params, batch)
        params, norm = state.update(grads, params)
        return params, {"loss": loss, "grad_norm": norm}

    return step
