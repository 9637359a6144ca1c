"""A pipeline for a model of one's own whose blocks are a stack (``StackLoss``).

The pipeline schedules cut a stack of blocks into stages; they drive a model through parts:
what runs before the blocks, one block, what runs after them and the loss. A ``Decoder``
hands these over by name. A model trained through its own ``loss_fn(model, batch)`` hands
over only its stack: ``blocks``, one module whose every parameter leads with the ``layers``
dim (``nnx.vmap``), applied by its forward pass as ``shardlib.run_stack(self.blocks, x)``
(``core.stack``). That is enough to cut the user's one loss into the parts:

* GPipe and circular replace the layer loop only, so the whole loss runs with the plan's
  layer loop installed under ``run_stack`` (``jax.grad`` differentiates the schedule);
* 1F1B writes forward and backward into one loop of its own and needs the parts apart:
  its embedding is the loss stopped at ``run_stack`` (the stack's input), its head the loss
  with ``run_stack`` returning the last stage's output, its block one merged layer. Both
  see the micro-batch's whole batch (every array, cut along its first dim).

The carry between blocks must be ``[batch, seq, embed]``: the pipelines' buffers
(``[stages, batch, seq, embed]``) hold that shape. The plan's remat policy runs in the layer
loop, per block, as it does for a decoder.

Refused before anything compiles, naming the fix (``check_stack``): a stage axis for a model
without such a stack, or whose forward does not call ``run_stack`` (once); state besides
parameters (the stages would have to carry it); the Chimera and TeraPipe schedules (token
rows only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
from flax import nnx

from shardlib.core.errors import ShardingError
from shardlib.core.param_info import LAYERS
from shardlib.core.stack import Captured, StackMode, stack_mode
from shardlib.train.user_loss import UserLoss

STACK = "blocks"  # the attribute the pipeline cuts (the ``Decoder`` protocol's name too)
SCHEDULES = ("gpipe", "circular", "1f1b")
_FIX = (
    "Fix: build the blocks as one stack, self.blocks = nnx.vmap(make_block, "
    "transform_metadata={nnx.PARTITION_NAME: 'layers'}) (every parameter [layers, ...]), "
    "apply them with shardlib.run_stack(self.blocks, x), or use a mesh without a stage axis"
)


def stack_problem(inv) -> str | None:
    """Why the model has no stack a pipeline can cut (``blocks``, every parameter leading
    with ``layers``), or None."""
    under = [p for p in inv.params if p.path.split(".")[0] == STACK]
    if not under:
        return f"it has no parameters under {STACK!r}"
    flat = [p for p in under if not p.names or p.names[0] != LAYERS]
    if flat:
        p = flat[0]
        return f"its parameter {p.path} {p.shape} names {p.names}, not a leading {LAYERS!r} dim"
    return None


def check_stack(name: str, inv, plan, model_state) -> None:
    """Refuse, naming the fix, a pipeline this model cannot run (module docstring)."""
    spec = plan.pipeline_spec()
    if spec is None:
        return
    problems = []
    reason = stack_problem(inv)
    if reason is not None:
        problems.append(f"a pipeline cuts a stack of blocks into stages, and {reason}. {_FIX}")
    if model_state:
        where = ", ".join(model_state.where[:3])
        problems.append(
            f"it holds state besides its parameters ({where}), which the pipeline's stages do "
            "not carry. Fix: a model without BatchNorm/Dropout RNG streams, or a mesh "
            "without a stage axis"
        )
    if spec.schedule not in SCHEDULES:
        problems.append(
            f"pipeline.schedule={spec.schedule} runs token rows only. Fix: "
            f"pipeline.schedule={' or '.join(SCHEDULES)}"
        )
    if problems:
        raise ShardingError(
            f"model {name} cannot run on the stage axis ({spec.stages} stages): "
            + "; ".join(problems)
            + "."
        )


@dataclass(frozen=True, eq=False)
class StackLoss(UserLoss):
    """The user's loss with its stack run by the plan's layer loop, whole or in the parts
    the 1F1B schedule runs (``parallel.gradients.StagedLoss``)."""

    layers: Callable | None = None
    """``ParallelPlan.layer_loop``: pipeline, remat."""

    def _loop(self, block_fn, blocks_state, x):
        check_carry(x)
        return self.layers(block_fn, blocks_state, x)

    def __call__(self, params, batch):
        with stack_mode(StackMode(layers=self._loop)) as calls:
            out = UserLoss.__call__(self, params, batch)
        once(calls)
        return out

    def split(self, batch):
        """The whole batch is the embedding's input and the loss's target."""
        return batch, batch, None, None

    def embed(self, params, batch, positions_L=None):
        """The loss up to ``run_stack``: the stack's input ``x`` [batch, seq, embed]."""
        with stack_mode(StackMode(capture=True)):
            try:
                UserLoss.__call__(self, params, batch)
            except Captured as seen:
                return seen.x
        once([])

    def block(self, block_graph, positions_L=None):
        def block_fn(layer_state, x):
            return nnx.merge(block_graph, layer_state)(x)

        return block_fn

    def head(self, params, x, batch, weights=None, totals=None):
        """(loss, metrics) of the loss with ``run_stack`` returning ``x``."""
        with stack_mode(StackMode(replace=x)):
            return UserLoss.__call__(self, params, batch)


def once(calls: list) -> None:
    if len(calls) != 1:
        raise ShardingError(
            f"loss_fn called shardlib.run_stack {len(calls)} times; a pipeline needs the "
            "stacked blocks applied exactly once per forward pass. Fix: apply self.blocks "
            "with one shardlib.run_stack(self.blocks, x) call."
        )


def check_carry(x) -> None:
    """Refuse a carry between the blocks that is not ``[batch, seq, embed]``."""
    if len(x.shape) != 3:
        raise ShardingError(
            f"run_stack: the carry between the stacked blocks has shape {x.shape}; a "
            "pipeline's buffers hold [batch, seq, embed]. Fix: carry x as [batch, seq, "
            "embed] (e.g. x[:, None, :] for one vector per example)."
        )


def check_loss(loss: UserLoss, params, batch) -> None:
    """Refuse, before compiling, a loss that does not apply its stack once on a
    ``[batch, seq, embed]`` carry (an abstract trace on one device)."""
    with stack_mode(StackMode(layers=lambda f, s, x: x)) as calls:
        jax.eval_shape(lambda p, b: UserLoss.__call__(loss, p, b), params, batch)
    once(calls)
    check_carry(calls[0])
