"""Which layers each pipeline stage runs when the layer count does not divide evenly.

The trainer and the planner both call ``balanced_stages``. Stages of one SPMD pipeline run
in lockstep, every stage executing k = ceil(L/G) layer slots per loop trip (G = p·v
stages, virtual ones included), so a stage with fewer real layers runs identity (masked)
slots: their FLOPs are computed and discarded, (G·k - L)/L extra on the layer stack. The
partition only chooses *where* those slots go: on the stages that also carry the embedding
(the first) and the head (the last), as Megatron-LM's first/last-stage layer counts and
PipeDream's partitioner do, so that an MPMD runtime, or a cost model that charges embedding
and head to their stages, sees balanced stages.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

EDGE_COST = 1.0
"""Default cost of the embedding (first stage) and of the head (last stage), in layers:
any positive value puts the identity slots there; the planner passes its FLOP ratios."""


def partition(
    costs: Sequence[float], stages: int, *, max_items: int | None = None
) -> tuple[tuple[int, int], ...]:
    """Split ``costs`` into ``stages`` contiguous, non-empty runs minimising the largest sum,
    with at most ``max_items`` items per run.

    Returns ``(start, end)`` index pairs. O(stages · n²) dynamic programming over prefix
    sums; ties go to the earliest cut so that the result is deterministic.
    """
    n = len(costs)
    cap = n if max_items is None else max_items
    if not 1 <= stages <= n or stages * cap < n:
        raise ValueError(f"cannot cut {n} layers into {stages} non-empty stages of <= {cap}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: smallest bottleneck for the first i items in k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(max(k - 1, i - cap), i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return tuple(reversed(bounds))


@functools.lru_cache(maxsize=4096)  # pure; the planner checks many plans of one shape
def balanced_stages(
    layers: int, stages: int, *, first: float = EDGE_COST, last: float = EDGE_COST
) -> tuple[int, ...]:
    """Real layers per stage, first to last: at most ceil(L/G) each, identity slots on the
    stages with the embedding (``first``: its cost in layers) and the head (``last``)."""
    costs = [1.0] * layers
    costs[0] += first
    costs[-1] += last
    cuts = partition(costs, stages, max_items=math.ceil(layers / stages))
    return tuple(end - start for start, end in cuts)


def padded_order(counts: Sequence[int]) -> tuple[list[int], list[float], list[int]]:
    """The padded stack of G·k slots for per-stage ``counts`` (k = max count).

    Returns (layer read by each slot, 1.0 for a real slot / 0.0 for an identity one, slot
    of each real layer). An identity slot reads its stage's first layer (finite weights:
    its discarded output gets an exact zero cotangent).
    """
    k = max(counts)
    source, keep, slot_of = [], [], []
    start = 0
    for n in counts:
        for j in range(k):
            if j < n:
                slot_of.append(len(source))
            source.append(start + j if j < n else start)
            keep.append(1.0 if j < n else 0.0)
        start += n
    return source, keep, slot_of


def pad_stages(blocks_state, counts: tuple[int, ...]):
    """Uneven stages: every stacked leaf [L, ...] -> [G·k, ...] in slot order, and keep [G·k]
    (1 real slot, 0 identity slot); (blocks_state, None) for even stages."""
    if len(set(counts)) <= 1:
        return blocks_state, None
    source, keep, _ = padded_order(counts)
    index = jnp.asarray(source)
    padded = jax.tree.map(lambda w: jnp.take(w, index, axis=0), blocks_state)
    return padded, jnp.asarray(keep, jnp.float32)


def unpad_stages(g_slots: jax.Array, counts: tuple[int, ...]) -> jax.Array:
    """[G·k, ...] per slot -> [L, ...] per real layer (identity slots dropped)."""
    if len(set(counts)) <= 1:
        return g_slots
    return jnp.take(g_slots, jnp.asarray(padded_order(counts)[2]), axis=0)


def masked(block_fn):
    """``block_fn`` over (weights, keep) slots: an identity slot passes its input through,
    so its output (computed, then discarded) gets an exact zero cotangent."""

    def slot(layer, x):
        w, keep = layer
        y = block_fn(w, x)
        return jax.tree.map(lambda a, b: jnp.where(keep > 0, a, b), y, x)

    return slot
