"""Pipeline parallelism: layers split into stages, micro-batches flow through them.

Formula-only until pipeline parallelism (issue 6) lands. Costs (Narayanan et al. 2021,
REFERENCE.md): the bubble is (p-1)/m of the ideal compute for GPipe and 1F1B and
(p-1)/(m·v) for the interleaved schedule with v virtual stages per device; GPipe keeps the
activations of all m micro-batches, 1F1B (and interleaved) at most p. Each stage boundary
sends one micro-batch's b·s·h activations forward and its gradient back (2·m·v permutes).

Stages are cut where the per-layer costs balance (``partition``): dynamic programming over
contiguous splits minimising the slowest stage, as PipeDream and Alpa do, so a model whose
layers differ (the output projection on the last stage) gets fewer blocks there.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from shardlib.mesh import Axis
from shardlib.planner.terms.base import Comm, Context, Contribution


def partition(costs: Sequence[float], stages: int) -> tuple[tuple[int, int], ...]:
    """Split ``costs`` into ``stages`` contiguous, non-empty runs minimising the largest sum.

    Returns ``(start, end)`` index pairs. O(stages · n²) dynamic programming over prefix
    sums; ties go to the earliest cut so that the result is deterministic.
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} layers into {stages} non-empty stages")
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
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        bounds.append((j, i))
        i = j
    return tuple(reversed(bounds))


@functools.lru_cache(maxsize=256)
def stage_layers(layers: int, layer_cost: float, head_cost: float, stages: int) -> tuple:
    """Blocks per stage when the last stage also runs the output projection."""
    if stages == 1:
        return (layers,)
    costs = [layer_cost] * layers + [head_cost]
    bounds = partition(costs, stages)
    return tuple(min(end, layers) - start for start, end in bounds)


def bubble_fraction(schedule: str, stages: int, microbatches: int, virtual: int) -> float:
    if stages == 1:
        return 0.0
    if schedule == "interleaved":
        return (stages - 1) / (microbatches * virtual)
    return (stages - 1) / microbatches


def in_flight(schedule: str, stages: int, microbatches: int) -> int:
    """Micro-batches whose activations the first stage holds at once."""
    if stages == 1:
        return 1
    return microbatches if schedule == "gpipe" else min(microbatches, stages)


def pipeline(ctx: Context) -> Contribution:
    p, w = ctx.p, ctx.w
    if p.stage <= 1:
        return Contribution()
    bsh = ctx.micro_batch * ctx.local_seq * w.embed / p.tensor * w.compute_bytes
    count = 2 * p.microbatches * p.virtual
    return Contribution(
        comms=(
            Comm(
                "pipeline",
                "activations",
                "collective-permute",
                (str(Axis.STAGE),),
                p.stage,
                bsh,
                count,
                True,
            ),
        ),
        notes=("pipeline: formula-only until issue 6 lands",),
    )
