"""Sublinear-memory checkpointing (Chen et al. 2016): ``remat=segments:k`` and ``remat=sqrt``.

Every per-layer policy (``parallel.remat``) still keeps something per layer: under
``full`` each block's input, so activation memory grows with the layer count L. Chen et
al. cut the L layers into k segments and keep only the k segment inputs in the forward
pass; the backward pass recomputes one segment's forward at a time, keeping that
segment's L/k layers' residuals (the inner policy's set) only while the segment's
backward runs. Kept memory is k·x + (L/k)·r for a layer input x and a layer's residuals r,
smallest at k ~ sqrt(L·r/x): it grows like sqrt(L), for one extra forward pass (the
outer recompute) when the inner policy is ``none``, two with ``full`` inside.

Here that is two nested scans over the stacked blocks, reshaped [L] -> [k, L/k]: the outer
scan runs ``jax.checkpoint`` (nothing saveable) of the inner scan, whose blocks carry the
inner policy. The spelling is ``segments:k`` or ``sqrt`` (k = a divisor of L nearest
sqrt(L), ``segment_count``), optionally ``+policy`` for the inner policy: ``sqrt+full``,
``segments:4+dots``, ``sqrt+names:mlp_hidden``. Under a GPipe/circular pipeline L is a
stage's layers per trip (the stage's ``stage_layers`` call); the 1F1B schedule decides
what it saves itself.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from shardlib.core.errors import ShardingError
from shardlib.core.ops import recomputed, scan_blocks

SQRT = -1
"""``RematSpec.segments`` for ``sqrt``: k chosen from the layer count when traced."""


def parse_segments(outer: str, text: str) -> int:
    """``"segments:4"`` -> 4, ``"sqrt"`` -> ``SQRT``; 0 for a plain per-layer policy."""
    if outer == "sqrt":
        return SQRT
    mode, _, count = outer.partition(":")
    if mode != "segments":
        return 0
    if not count.isdigit() or int(count) < 1:
        raise ShardingError(
            f"remat={text!r}: segments needs a positive segment count. Fix: e.g. "
            "remat=segments:4, or remat=sqrt to choose it from the layer count."
        )
    return int(count)


def segment_count(segments: int, layers: int) -> int:
    """Segments for ``layers`` stacked blocks: ``segments`` itself (it must divide them),
    or for ``SQRT`` the divisor k of ``layers`` with the least k + L/k (Chen et al.'s cost
    with x = r), the larger on a tie: a layer keeps at least its input, r >= x (L = 32:
    8 segments of 4, not 4 of 8)."""
    if segments == SQRT:
        divisors = [d for d in range(1, layers + 1) if layers % d == 0]
        return min(divisors, key=lambda d: (d + layers // d, -d))
    if layers % segments:
        raise ShardingError(
            f"remat=segments:{segments}: the layer loop runs {layers} stacked blocks "
            f"(a pipeline stage's share where there is one), which {segments} segments do "
            f"not divide. Fix: a divisor of {layers}, or remat=sqrt."
        )
    return segments


def scan_segments(block_fn: Callable, blocks_state, carry, segments: int):
    """``scan_blocks`` over [k, L/k]-reshaped blocks: the outer scan keeps each segment's
    input only; ``block_fn`` (already under the inner policy) runs in the inner scan."""
    layers = jax.tree.leaves(blocks_state)[0].shape[0]
    k = segment_count(segments, layers)
    if k in (1, layers) and segments == SQRT:
        return scan_blocks(block_fn, blocks_state, carry)  # nothing nested (L = 1, 2, 3)
    grouped = jax.tree.map(lambda w: w.reshape(k, layers // k, *w.shape[1:]), blocks_state)

    def segment(segment_state, c):  # [L/k, ...] blocks, one segment's input
        return scan_blocks(block_fn, segment_state, c)

    nothing = jax.checkpoint_policies.nothing_saveable  # the segment input: the scan keeps it
    outer = jax.checkpoint(recomputed(segment), policy=nothing, prevent_cse=False)
    return scan_blocks(outer, grouped, carry)
