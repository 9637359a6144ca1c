"""Attention kernels and the ``AttentionPlan`` that picks one: ``attend(q, k, v, pos, plan=)``.

Model code names logical dims only and cannot know whether its sequence is split over a
``context`` axis, so it calls ``shardlib.ops.attention``, which hands the active plan to
``attend`` here: dense (the default), chunked (memory-efficient) or cuDNN on one device,
and ring, all-to-all (Ulysses) or all-gather across the context axis, each a small
``shard_map`` kernel around a local one. Outside ``use_layout`` every plan runs locally.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from shardlib.errors import ShardingError
from shardlib.kernels import shard_map
from shardlib.kernels.blockwise import (
    NEG_INF,
    chunked_attention,
    dense_attention,
    from_groups,
    pick_chunk,
    to_groups,
)
from shardlib.kernels.gathered import all_gather_attention, ulysses_attention
from shardlib.kernels.ring_attention import ring_attention
from shardlib.layout import active_layout, mesh_axes
from shardlib.mesh import Axis
from shardlib.rules import resolve_spec

CONTEXT_KINDS = ("none", "ring", "all_to_all", "all_gather")
IMPLS = ("dense", "chunked", "cudnn")


@dataclass(frozen=True)
class AttentionPlan:
    """How attention runs on a mesh: ``ContextParallel.attention_plan`` resolves the plan's
    ``[parallel.context]`` settings against the mesh's context axis."""

    context: str = "none"
    """Across the context axis: none | ring | all_to_all (Ulysses) | all_gather."""
    impl: str = "dense"
    """On each device: dense (O(s²) scores), chunked (online softmax, O(chunk²)) or cudnn."""
    chunk: int = 512
    """Query/key block length of chunked attention and of ring attention's inner blocks."""
    load_balance: bool = True
    """Zig-zag token order for ring and all-gather attention (equal causal work per device)."""
    axis: str = Axis.CONTEXT
    """The mesh axis the sequence is split over."""
    axis_size: int = 1
    """Its size (the token order depends on it)."""

    def __post_init__(self) -> None:
        if self.context not in CONTEXT_KINDS:
            raise ShardingError(
                f"attention={self.context!r} is unknown. Fix: use one of "
                f"{', '.join(CONTEXT_KINDS[1:])} (or none without a context axis)."
            )
        if self.impl not in IMPLS:
            raise ShardingError(
                f"attention_impl={self.impl!r} is unknown. Fix: use one of {', '.join(IMPLS)}."
            )
        object.__setattr__(self, "axis", str(self.axis))  # plain str, also for Axis members
        if self.chunk < 1:
            raise ShardingError(f"attention_chunk={self.chunk} must be >= 1.")

    @property
    def zigzag(self) -> bool:
        return self.load_balance and self.axis_size > 1 and self.context in ("ring", "all_gather")

    def token_order(self, seq: int) -> np.ndarray | None:
        """Positions in the order the model sees them, or None for the natural order."""
        return zigzag_order(seq, self.axis_size) if self.zigzag else None


def zigzag_order(seq: int, n: int) -> np.ndarray:
    """Zig-zag assignment of 2n sequence chunks to n devices: device i gets i and 2n-1-i.

    Under a causal mask the first chunks attend to little and the last to everything;
    pairing chunk i with chunk 2n-1-i gives every device the same work. Returned is the
    permutation ``order`` such that ``tokens[:, order]``, split contiguously over the axis,
    gives each device its two chunks; ``order[j]`` is the true position of slot j.
    """
    if seq % (2 * n):
        raise ShardingError(
            f"zig-zag load balancing splits seq={seq} into 2 x context = {2 * n} chunks, "
            f"which does not divide it. Fix: make seq a multiple of {2 * n}, or set "
            "load_balance=false."
        )
    c = seq // (2 * n)
    chunks = [(i, 2 * n - 1 - i) for i in range(n)]
    return np.concatenate([np.arange(j * c, (j + 1) * c) for pair in chunks for j in pair])


@partial(jax.tree_util.register_dataclass, data_fields=["positions", "segments"], meta_fields=[])
@dataclass(frozen=True)
class Packed:
    """Positions and document ids of packed rows: several documents share one row.

    Passed where a model takes ``positions_L``: RoPE reads the per-row ``positions`` (they
    restart at 0 for each document) and attention keeps each query inside its own document
    (``segments`` equal) as well as causal. Segment 0 is padding.
    """

    positions: jax.Array = field()  # [batch, seq] int32, 0.. within each document
    segments: jax.Array = field()  # [batch, seq] int32, 1.. per document in the row, 0: pad


def packed_attention(q_BLHK, k_BTGK, v_BTGK, packed: Packed):
    """Dense attention with grouped K/V heads, causal within each packed document only."""
    g, d = k_BTGK.shape[2], q_BLHK.shape[-1]
    q_BGRQK = to_groups(q_BLHK, g)
    s_BGRQT = jnp.einsum(
        "bgrqk,btgk->bgrqt", q_BGRQK, k_BTGK, preferred_element_type=jnp.float32
    ) * (d**-0.5)
    pos_BL, seg_BL = packed.positions, packed.segments
    same_BQT = seg_BL[:, :, None] == seg_BL[:, None, :]
    mask_BQT = same_BQT & (pos_BL[:, :, None] >= pos_BL[:, None, :])
    s_BGRQT = jnp.where(mask_BQT[:, None, None], s_BGRQT, NEG_INF)
    probs = jax.nn.softmax(s_BGRQT, axis=-1).astype(v_BTGK.dtype)
    out_BGRQK = jnp.einsum("bgrqt,btgk->bgrqk", probs, v_BTGK)
    return from_groups(out_BGRQK).astype(q_BLHK.dtype)


def check_packed(plan: AttentionPlan) -> None:
    """Packed rows (document masks) run the dense kernel on whole sequences only."""
    if plan.context != "none" or plan.impl != "dense":
        raise ShardingError(
            f"packed documents (a prepared dataset) need dense attention on whole sequences; "
            f"this plan runs attention={plan.context}, attention_impl={plan.impl}. Fix: a mesh "
            "without a context axis and attention_impl=dense, or a flat token file."
        )


def _cudnn(q, k, v, q_pos, k_pos, *, causal):
    # cuDNN's fused kernel knows only the natural order: plans never pair it with zig-zag.
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def local_kernel(plan: AttentionPlan, causal: bool, local_len: int):
    """``inner(q, k, v, q_pos, k_pos)`` for one device."""
    if plan.impl == "chunked":
        return partial(chunked_attention, causal=causal, chunk=pick_chunk(local_len, plan.chunk))
    if plan.impl == "cudnn":
        return partial(_cudnn, causal=causal)
    return partial(dense_attention, causal=causal)


def attend(q_BLHK, k_BLGK, v_BLGK, positions_L=None, *, plan: AttentionPlan, causal: bool = True):
    """Causal (or full) attention with grouped K/V heads: [B, L, H, K] -> [B, L, H, K].

    ``positions_L`` are the true positions of the L tokens (default ``arange(L)``): they
    drive the causal mask, so a permuted token order (zig-zag) attends correctly. ``Packed``
    positions (several documents per row) mask attention across documents.
    """
    if isinstance(positions_L, Packed):
        check_packed(plan if active_layout() is not None else AttentionPlan(impl=plan.impl))
        return packed_attention(q_BLHK, k_BLGK, v_BLGK, positions_L)
    seq = q_BLHK.shape[1]
    pos = jnp.arange(seq, dtype=jnp.int32) if positions_L is None else positions_L
    active = active_layout()
    if plan.context == "none" or active is None:
        return local_kernel(plan, causal, seq)(q_BLHK, k_BLGK, v_BLGK, pos, pos)
    mesh, rules = active
    axes = mesh_axes(mesh)
    if plan.axis not in axes:
        raise ShardingError(
            f"attention={plan.context} runs over mesh axis {plan.axis!r}, which the mesh "
            f"({', '.join(f'{a}={s}' for a, s in axes.items())}) lacks. Fix: add it."
        )
    if rules.activations.get("seq") != (plan.axis,):
        raise ShardingError(
            f"attention={plan.context} needs the activation rule seq -> ({plan.axis!r},), got "
            f"{rules.activations.get('seq')}. Fix: compose strategies.context_parallel()."
        )
    n = axes[plan.axis]
    q_names, kv_names = (
        ("batch", "seq", "heads", "head_dim"),
        ("batch", "seq", "kv_heads", "head_dim"),
    )
    q_spec = resolve_spec("attention q", q_BLHK.shape, q_names, rules, axes, "activations")
    kv_spec = resolve_spec("attention k/v", k_BLGK.shape, kv_names, rules, axes, "activations")
    local = seq // n
    if plan.context == "ring":
        block = local // 2 if plan.zigzag else local
        chunk = pick_chunk(block, plan.chunk) if plan.impl == "chunked" else block
        fn = partial(ring_attention, axis_name=plan.axis, axis_size=n, causal=causal, chunk=chunk)
    elif plan.context == "all_to_all":
        check_ulysses(q_BLHK.shape[2], k_BLGK.shape[2], q_spec, kv_spec, axes, plan.axis)
        inner = local_kernel(plan, causal, seq)
        fn = partial(ulysses_attention, axis_name=plan.axis, inner=inner)
    else:
        inner = local_kernel(plan, causal, local)
        fn = partial(all_gather_attention, axis_name=plan.axis, inner=inner)
    pos_spec = P(plan.axis)
    kernel = shard_map(
        fn, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, pos_spec, pos_spec), out_specs=q_spec
    )
    return kernel(q_BLHK, k_BLGK, v_BLGK, pos, pos)


def _ways(spec: P, dim: int, axes: dict[str, int]) -> int:
    part = spec[dim] if dim < len(spec) else None
    names = () if part is None else (part,) if isinstance(part, str) else tuple(part)
    return int(np.prod([axes[a] for a in names], dtype=int))


def check_ulysses(heads: int, kv_heads: int, q_spec: P, kv_spec: P, axes: dict, axis: str):
    """Ulysses splits each device's heads (and K/V heads) over the context axis: check it."""
    n = axes[axis]
    for name, count, spec in (("heads", heads, q_spec), ("kv_heads", kv_heads, kv_spec)):
        local = count // _ways(spec, 2, axes)
        if local % n:
            raise ShardingError(
                f"attention=all_to_all (Ulysses) splits {name}: {count} {name} leave {local} per "
                f"device after the other axes, which does not divide by {axis}={n}. Fix: use a "
                f"context axis dividing {local}, a model whose {name} divide, or attention=ring."
            )
