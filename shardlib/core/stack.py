"""``run_stack``: how a model of one's own applies its stacked blocks, so a trainer can
pipeline them.

A ``Decoder`` hands the library its embedding, blocks and head apart. A model trained through
its own loss (``train.user_model``) is one function, ``loss_fn(model, batch)``; to let the
library cut its blocks into pipeline stages it applies them with ``run_stack(self.blocks,
x)`` instead of a loop of its own. ``blocks`` is one module whose every parameter has a
leading ``layers`` dim (built with ``nnx.vmap(..., transform_metadata={nnx.PARTITION_NAME:
"layers"})``, as ``Decoder.blocks``), a block maps ``x -> x`` of one shape.

Outside a trainer ``run_stack`` is a ``jax.lax.scan`` over the layers: the model runs as it
is on one device. Inside, the trainer installs (``stack_mode``) one of three modes:

* ``layers``: the plan's layer loop runs the stack (GPipe, circular, remat policies);
* ``capture``: the loss stops at the stack and hands back its input (``Captured``): what the
  model computes before its blocks, which the 1F1B schedule runs as its embedding;
* ``replace``: the stack returns a given output: the loss after the blocks, which the 1F1B
  schedule runs as its head (what comes before is traced but unused, so XLA drops it).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import jax
from flax import nnx

from shardlib.core.errors import ShardingError
from shardlib.core.ops import scan_blocks

__all__ = ["Captured", "StackMode", "run_stack", "stack_mode"]


@dataclass(frozen=True)
class StackMode:
    """What ``run_stack`` does inside a trainer (module docstring); one field is set."""

    layers: Callable | None = None
    """``layers(block_fn, blocks_state, x) -> x``: the plan's layer loop."""
    capture: bool = False
    """Stop at the stack: raise ``Captured`` with its input."""
    replace: Any = None
    """The stack's output, whatever its input."""


class Captured(Exception):  # noqa: N818 (not an error: the loss stopped where it was asked)
    """Raised by ``run_stack`` in ``capture`` mode, carrying the stack's input ``x``."""

    def __init__(self, x):
        super().__init__("run_stack captured its input")
        self.x = x


_MODE: contextvars.ContextVar[StackMode | None] = contextvars.ContextVar(
    "shardlib_stack_mode", default=None
)
_CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "shardlib_stack_calls", default=None
)


@contextlib.contextmanager
def stack_mode(mode: StackMode) -> Iterator[list]:
    """``run_stack`` in ``mode`` inside the block; yields a list that counts its calls."""
    calls: list = []
    token, counted = _MODE.set(mode), _CALLS.set(calls)
    try:
        yield calls
    finally:
        _MODE.reset(token)
        _CALLS.reset(counted)


def run_stack(blocks: nnx.Module, x):
    """``x`` through every block of the stack ``blocks``, first to last (module docstring).

    ``x``: the carry between blocks, one array (under a pipeline ``[batch, seq, embed]``,
    the shape the pipeline's buffers hold); each block returns an array of its shape."""
    calls = _CALLS.get()
    if calls is not None:
        calls.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
    mode = _MODE.get()
    if mode is not None and mode.capture:
        raise Captured(x)
    if mode is not None and mode.replace is not None:
        if mode.replace.shape != x.shape:
            raise ShardingError(
                f"run_stack: the stack's input has shape {x.shape} here but "
                f"{mode.replace.shape} where the pipeline embedded it: the loss must call "
                "run_stack once, on the same input. Fix: one run_stack call per forward."
            )
        return mode.replace
    block_graph, blocks_state = nnx.split(blocks)

    def block_fn(layer_state, carry):
        return nnx.merge(block_graph, layer_state)(carry)

    layers = scan_blocks if mode is None else mode.layers
    return layers(block_fn, blocks_state, x)
