"""A block's view of one slice of its sequence, for token-level pipelining (TeraPipe).

TeraPipe (``parallel/pipeline/terapipe.py``) runs the model's own block on a slice of the
sequence at a time. The block cannot know that: it calls ``ops.attention`` and takes its
positions from ``ops.run_blocks``. So the pipeline sets the slice here (``token_slice``),
and those two ops read it: the positions become the slice's true ones (rotary, causal
mask), and attention runs the slice's queries against the keys/values of the earlier
slices the pipeline keeps, leaving the slice's own keys/values for it to store. Kept apart
from ``ops`` because no other layout needs it: ``ops`` asks ``active_slice`` and hands the
rest here.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["TokenSlice", "active_slice", "slice_positions", "sliced_attention", "token_slice"]


@dataclass
class TokenSlice:
    """One block's view of a slice of the sequence.

    The block sees tokens ``offset .. offset+L-1`` only; its ``attention`` call attends
    to them and to the keys/values of the earlier tokens, which the pipeline keeps per
    layer in ``prefix_k``/``prefix_v`` ([B, seq, G, K], whole sequence; slots at and after
    ``offset`` are masked by position). The call leaves its own (rotated) ``k``/``v``
    [B, L, G, K] here for the pipeline to store. With no prefix (a shape probe) it attends
    to its own tokens only. Mutable, and read in the same trace that set it.
    """

    offset: Any
    prefix_k: Any = None
    prefix_v: Any = None
    k: Any = None
    v: Any = None


_SLICE: contextvars.ContextVar[TokenSlice | None] = contextvars.ContextVar(
    "shardlib_token_slice", default=None
)


@contextlib.contextmanager
def token_slice(slot: TokenSlice) -> Iterator[TokenSlice]:
    """Inside: blocks run on the sequence slice ``slot`` describes (positions from its
    offset, attention over the kept prefix); the outer slice, if any, comes back after."""
    token = _SLICE.set(slot)
    try:
        yield slot
    finally:
        _SLICE.reset(token)


def active_slice() -> TokenSlice | None:
    """The slice blocks are running on now; None: the whole sequence (every other layout)."""
    return _SLICE.get()


def slice_positions(positions_L, length: int):
    """The positions a block's tokens have: the model's, or a token slice's true ones."""
    slot = _SLICE.get()
    if slot is None:
        return positions_L
    if positions_L is not None:
        raise ValueError(
            "a token-sliced pipeline (pipeline_schedule=terapipe) got explicit positions "
            "(packed documents): not supported. Fix: a flat token file, or another schedule."
        )
    return slot.offset + jnp.arange(length, dtype=jnp.int32)


def sliced_attention(slot: TokenSlice, form, q_BLHK, k_BLGK, v_BLGK, positions_L, causal):
    """Attention of a token slice: its queries against the prefix plus its own keys, with
    ``form`` (the active attention form; its local kernel where it is a context form)."""
    if slot.k is not None:
        raise ValueError("a token slice's block called attention twice; TeraPipe keeps one K/V.")
    slot.k, slot.v = k_BLGK, v_BLGK
    if positions_L is None:  # a block called without ``run_blocks``: the slice's own
        positions_L = slice_positions(None, q_BLHK.shape[1])
    form = getattr(form, "local", form)  # a context form's local kernel (no context axis)
    if not hasattr(form, "kernel") or not causal:
        raise ValueError(
            f"pipeline_schedule=terapipe runs causal local attention; this block has "
            f"{type(form).__name__} (causal={causal}). Fix: no context axis, a causal model."
        )
    if slot.prefix_k is None:  # shape probe
        return form.kernel(causal, q_BLHK.shape[1])(
            q_BLHK, k_BLGK, v_BLGK, positions_L, positions_L
        )
    k_BTGK = jax.lax.dynamic_update_slice_in_dim(slot.prefix_k, k_BLGK, slot.offset, 1)
    v_BTGK = jax.lax.dynamic_update_slice_in_dim(slot.prefix_v, v_BLGK, slot.offset, 1)
    k_pos_T = jnp.arange(k_BTGK.shape[1], dtype=jnp.int32)
    return form.kernel(causal, k_BTGK.shape[1])(q_BLHK, k_BTGK, v_BTGK, positions_L, k_pos_T)
