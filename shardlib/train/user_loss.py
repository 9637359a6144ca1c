"""The user's loss as the trainer's gradient path takes it: ``(params, batch) -> (loss,
metrics)`` on the merged model (``UserLoss``), with the plan's remat on its layers
(``remat_layers``) and, for a model holding state besides its parameters, that state read
from and written back to the train state (``train.user_state``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardlib.core.errors import ShardingError
from shardlib.parallel.gradients import micro_batch_index
from shardlib.parallel.remat import RematSpec
from shardlib.train import user_state


@dataclass(frozen=True, eq=False)
class UserLoss:
    """``(params, batch) -> (loss, metrics)`` of the user's ``loss_fn(model, batch)``, the
    fp32 master weights cast to the compute dtype and the plan's remat on the layers."""

    graphdef: nnx.GraphDef
    loss_fn: Callable
    dtype: Any
    remat: RematSpec
    state_keys: frozenset | None = None
    """With model state (``train.user_state``): the paths of its RNG keys; None: none."""
    model_state: Any = None
    """This step's model state (``given``), closed over: never differentiated."""
    masters: frozenset = frozenset()
    """Top-level parameter entries left in fp32 (a pipeline's stacked blocks: each stage
    casts its own per trip, so their gradients accumulate in fp32, as a decoder's do)."""
    training: bool = True
    """False: the model in eval mode (``nnx.Module.eval``: no dropout, BatchNorm on its
    running statistics) and its state not read back (held-out evaluation)."""

    def _cast(self, p):
        return p.astype(self.dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p

    def given(self, model_state) -> UserLoss:
        """The loss on the train state's model state (BatchNorm statistics, RNG counts)."""
        return dataclasses.replace(self, model_state=model_state)

    def next_state(self, old, forward):
        """The next step's model state from what the forward pass wrote (``user_state``)."""
        return user_state.settle(old, forward, self.state_keys)

    def __call__(self, params, batch):
        params = {
            k: v if k in self.masters else jax.tree.map(self._cast, v) for k, v in params.items()
        }
        if self.state_keys is None:
            model = nnx.merge(self.graphdef, params)
        else:  # the forward runs in train mode as built, writing its statistics and counts
            held = user_state.as_model_state(self.model_state, self.state_keys)
            index = micro_batch_index()
            if index is not None:  # each micro-batch its own dropout masks
                held = user_state.fold_keys(held, self.state_keys, index)
            model = nnx.merge(self.graphdef, params, held)
        if not self.training:
            model.eval()
        elif self.remat.active:
            remat_layers(model, self.remat)
        out = self.loss_fn(model, batch)
        loss, metrics = out if isinstance(out, tuple) else (out, {})
        if not isinstance(metrics, dict):
            raise ShardingError(
                f"loss_fn returned {type(metrics).__name__} as its metrics. Fix: return "
                "(loss, {'name': scalar, ...}) or the loss alone."
            )
        if jnp.shape(loss) != ():
            raise ShardingError(
                f"loss_fn returned a loss of shape {jnp.shape(loss)}; the trainer needs a "
                "scalar. Fix: reduce it, e.g. loss.mean()."
            )
        reserved = sorted(set(metrics) & {"grad_norm", "lr", "step", user_state.MODEL_STATE})
        if reserved:
            raise ShardingError(
                f"loss_fn's metrics name {reserved[0]!r}, which the trainer reports itself. "
                f"Fix: another name, e.g. {reserved[0]}_model."
            )
        metrics = {  # "loss" is the trainer's own record of the returned loss
            k: jnp.asarray(v, jnp.float32) for k, v in metrics.items() if k != "loss"
        }
        if self.state_keys is not None and self.training:  # the step takes it out
            metrics[user_state.MODEL_STATE] = user_state.carried(model, self.state_keys)
        return jnp.asarray(loss, jnp.float32), metrics


def remat_layers(model: nnx.Module, spec: RematSpec) -> int:
    """The model's layers under ``nnx.remat`` with ``spec``'s policy: every module held in a
    list (``nnx.List``), or, for a model without one, each of its direct sub-modules (a
    conv net's ``conv1``, ``conv2``, ``head``). Applied to the copy merged inside the step
    (its classes are swapped; the user's code is unchanged). Returns how many were wrapped."""
    layers = [
        item
        for _, node in nnx.iter_graph(model)
        if isinstance(node, nnx.List | list)
        for item in node
        if isinstance(item, nnx.Module)
    ]
    if not layers:
        layers = [
            child
            for child in vars(model).values()
            if isinstance(child, nnx.Module) and not isinstance(child, nnx.List)
        ]
    for layer in layers:
        layer.__class__ = _rematted(type(layer), spec)
    return len(layers)


@functools.cache
def _rematted(base: type, spec: RematSpec) -> type:
    if getattr(base, "_shardlib_remat", False):
        return base

    def __call__(self, *args, **kwargs):
        def run(module, *a):
            return base.__call__(module, *a, **kwargs)

        return nnx.remat(run, policy=spec.policy())(self, *args)

    return type(base.__name__, (base,), {"__call__": __call__, "_shardlib_remat": True})
