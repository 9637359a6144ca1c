"""The embedding lookup, written out where FSDP splits the table on vocab.

Megatron's vocab-parallel lookup (Shoeybi et al. 2019): each device holds a block of the
table's rows, looks up the tokens that fall in it (others read as zero), and the partial
rows are summed over the devices that split vocab. Under tensor parallelism alone XLA
derives this form from the layouts. Under FSDP's vocab-parallel table
(``parallel.fsdp``) the token batch is split over the same ``fsdp`` axis as the
table's rows, and XLA's gather partitioner then sometimes gathers the whole table instead
(data 8 x fsdp 8, jax 0.10.2, CPU: an 8 MiB all-gather and an all-reduce of its
gradient over all 64 devices). So here it is explicit, as Megatron writes it:

* forward: the token ids are gathered over ``fsdp`` (a few KiB), each device looks up its
  rows, the partial rows are reduce-scattered over ``fsdp`` straight into the residual
  stream's batch split (one reduce-scatter where an all-reduce and a slice would move
  twice the bytes) and then summed over the other vocab axes (``tensor``);
* backward (``custom_vjp``): the rows' cotangent is gathered over ``fsdp`` and each
  device scatter-adds into its own block of rows, summed over the axes that split the
  tokens otherwise (``data``, ``context``): the table's gradient, already in its layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from shardlib.core.layout import activation_spec, active_layout, constrain, mesh_axes
from shardlib.core.rules import entry_axes
from shardlib.core.shard_map import shard_map

TABLE = ("vocab", "embed")
TOKENS = ("batch", "seq")


def lookup(table_VD: jax.Array, tokens_BL: jax.Array) -> jax.Array:
    """Rows of ``table_VD`` [vocab, embed] at ``tokens_BL`` [batch, seq]: [batch, seq, embed].

    Outside a layout, or where no shared (FSDP) axis splits vocab, ``jnp.take`` on the
    table in its activation layout (vocab-parallel, embed whole): XLA emits Megatron's
    masked lookup and all-reduce. Otherwise the explicit form of the module docstring.
    """
    active = active_layout()
    table_VD = constrain(table_VD, TABLE, what="embedding table [vocab, embed]")
    if active is None:
        return jnp.take(table_VD, tokens_BL, axis=0)
    mesh, rules = active
    axes = mesh_axes(mesh)
    vocab = table_VD.shape[0]
    table_spec = activation_spec("embedding table", table_VD.shape, TABLE, rules, axes)
    vocab_axes = entry_axes(table_spec[0] if len(table_spec) else None)
    shared = tuple(a for a in vocab_axes if a in rules.shared and axes[a] > 1)
    if not shared:
        return jnp.take(table_VD, tokens_BL, axis=0)
    where = "token ids [batch, seq]"
    tok_spec = activation_spec(where, tokens_BL.shape, TOKENS, rules, axes, {"vocab": vocab})
    tok_spec = (*tok_spec, *(None,) * (2 - len(tok_spec)))
    embed_entry = table_spec[1] if len(table_spec) > 1 else None
    batch = entry_axes(tok_spec[0])
    out_spec = P((*batch, *shared), tok_spec[1], embed_entry)
    token_axes = (*batch, *entry_axes(tok_spec[1]))  # they hold different tokens: sum the grads
    kernel = _kernel(mesh, vocab_axes, shared, token_axes, P(*tok_spec), out_spec, table_spec)
    return kernel(table_VD, tokens_BL)


def _kernel(mesh, vocab_axes, shared, token_axes, tok_spec, out_spec, table_spec):
    """The custom-vjp lookup over ``mesh`` (specs as ``lookup`` resolved them)."""
    others = tuple(a for a in vocab_axes if a not in shared)

    def local_rows(table, tokens):
        """(row index into this device's block, whether the token falls in it)."""
        rows = table.shape[0]
        start = jax.lax.axis_index(vocab_axes) * rows
        local = tokens - start
        hit = (local >= 0) & (local < rows)
        return jnp.where(hit, local, 0), hit

    def fwd_local(table, tokens):
        index, hit = local_rows(table, tokens)
        x = jnp.where(hit[..., None], jnp.take(table, index, axis=0), 0)
        x = jax.lax.psum_scatter(x, shared, scatter_dimension=0, tiled=True)
        return jax.lax.psum(x, others) if others else x  # on the scattered rows: 1/fsdp

    def bwd_local(table, tokens, dx):
        dx = jax.lax.all_gather(dx, shared, axis=0, tiled=True)
        index, hit = local_rows(table, tokens)
        rows = jnp.where(hit[..., None], dx, 0).astype(table.dtype)
        grad = _zeros_after(table, rows).at[index].add(rows)
        return jax.lax.psum(grad, token_axes) if token_axes else grad

    forward = shard_map(fwd_local, mesh=mesh, in_specs=(table_spec, tok_spec), out_specs=out_spec)
    backward = shard_map(
        bwd_local, mesh=mesh, in_specs=(table_spec, tok_spec, out_spec), out_specs=table_spec
    )

    @jax.custom_vjp
    def run(table, tokens):
        return forward(table, tokens)

    def run_fwd(table, tokens):
        return forward(table, tokens), (table, tokens)

    def run_bwd(res, dx):
        table, tokens = res
        return backward(table, tokens, dx), _int_zero(tokens)

    run.defvjp(run_fwd, run_bwd)
    return run


def _zeros_after(table_VD, rows_BLD):
    """Zeros like ``table_VD`` that XLA cannot allocate before ``rows_BLD`` exists.

    A broadcast constant has no operands, and XLA's CPU scheduler places the zero gradient
    table at the start of the step: it then stays live through the whole forward and
    backward layer loops (4 MiB per device on data 2 x fsdp 2 x tensor 2, at the peak).
    Adding min(|r|, 0) of one cotangent element, 0 for every finite or infinite r, makes
    it wait for the cotangent. A NaN r spreads to the whole table, which changes nothing
    that matters: the gradient was non-finite already.
    """
    tie = jnp.minimum(jnp.abs(rows_BLD.reshape(-1)[0]), 0).astype(table_VD.dtype)
    return jnp.zeros_like(table_VD) + tie


def _int_zero(tokens):
    """The cotangent of integer token ids (float0 zeros)."""
    return np.zeros(tokens.shape, dtype=jax.dtypes.float0)
