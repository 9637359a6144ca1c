"""Small ``shard_map`` kernels for what XLA's propagation cannot schedule on its own.

``shard_map`` moved from ``jax.experimental.shard_map`` to ``jax.shard_map`` (jax 0.6+,
keyword ``check_vma`` replacing ``check_rep``); ``shard_map`` here takes whichever exists.
"""

from __future__ import annotations

import jax


def shard_map(fn, *, mesh, in_specs, out_specs):
    """Per-device ``fn`` over every axis of ``mesh``; replication is not type-checked.

    The kernels mix ``ppermute``/``all_to_all`` with ``custom_vjp``, whose varying-axis
    bookkeeping differs between jax versions; the parity tests check the results instead.
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    from jax.experimental.shard_map import shard_map as legacy  # pragma: no cover

    return legacy(fn, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
