"""ZeRO++ (Wang et al. 2023): ZeRO-3's three collectives made cheaper across nodes.

ZeRO-3 moves 3Ψ per step: a weight all-gather in forward, another in backward, a gradient
reduce-scatter. ZeRO++ shrinks each, one setting of ``[parallel.data]`` apiece:

* qwZ (``quantized_weights``): each device quantizes its weight shard to int8 in blocks
  (one fp32 scale per block), the all-gather carries int8, receivers dequantize: half the
  bytes of an fp16/bf16 gather.
* hpZ (``hpz``): the mesh is ``data x fsdp`` with ``fsdp`` inside a node. Forward gathers
  over ``data`` (across nodes) first; that intermediate, the weights split over ``fsdp``
  only, is the *secondary partition* kept for the backward pass, whose gather then runs
  over ``fsdp`` alone: no backward weight traffic across nodes.
* qgZ (``quantized_gradients``): the gradient reduce-scatter becomes an all-to-all of
  block-quantized chunks (int4 by default, the paper's choice); each device dequantizes
  the N versions of its own chunk and sums them in fp32. (The paper runs it in two hops,
  inside then across nodes; here one hop over each gathered axis, which is that with hpZ.)

These collectives must carry int8/uint8, which GSPMD propagation would never choose, so the
gradient is computed in ``shard_map`` over the batch axes: parameters enter as their ZeRO-3
shards, ``gather`` (a ``custom_vjp``) rebuilds them, and its backward is the (quantized)
reduce-scatter. The gathered weights are tagged so that the backward pass gathers them again
instead of keeping them (``jax.checkpoint`` with every other value saveable), as ZeRO-3
frees them after use. Weights are gathered whole before the layer loop, not per layer: the
bytes on the wire are ZeRO-3's, the peak memory is not.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardlib.core.errors import ShardingError
from shardlib.core.layout import suspend_layout
from shardlib.core.mesh import Axis
from shardlib.parallel.compression import dequantize_blocks, quantize_blocks

BLOCK = 256  # elements per quantization block (one fp32 scale each): 1.6% on int8


def _blocks(x_N: jax.Array) -> tuple[jax.Array, int]:
    """[n] -> ([n_blocks, block], n): zero-padded to whole blocks (block even, <= BLOCK)."""
    n = x_N.shape[0]
    block = min(BLOCK, n + n % 2)
    pad = -n % block
    return jnp.pad(x_N, (0, pad)).reshape(-1, block), n


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather(x_N: jax.Array, axes: tuple[str, ...], weight_bits: int, grad_bits: int):
    """All-gather of a flat shard over ``axes``: [n] -> [G, n] (G devices, data-major).

    ``weight_bits`` 8: int8 blocks on the wire (qwZ); 0: the array's own dtype. The backward
    pass reduce-scatters the cotangent [G, n] -> [n]: with ``grad_bits`` 4/8 as an all-to-all
    of quantized blocks summed in fp32 after (qgZ), with 0 as a plain reduce-scatter.
    """
    if not weight_bits:
        return jax.lax.all_gather(x_N, axes)
    x_BK, n = _blocks(x_N.astype(jnp.float32))
    codes, scale = quantize_blocks(x_BK, weight_bits)
    codes_G = jax.lax.all_gather(codes, axes)  # [G, blocks, K] int8
    scale_G = jax.lax.all_gather(scale, axes)  # [G, blocks] fp32
    full_GN = dequantize_blocks(codes_G, scale_G, weight_bits).reshape(codes_G.shape[0], -1)
    return full_GN[:, :n].astype(x_N.dtype)


def _gather_fwd(x_N, axes, weight_bits, grad_bits):
    return gather(x_N, axes, weight_bits, grad_bits), None


def _gather_bwd(axes, weight_bits, grad_bits, _, ct_GN):
    if not grad_bits:
        return (jax.lax.psum_scatter(ct_GN, axes, scatter_dimension=0),)
    ct_GBK = jax.vmap(lambda row: _blocks(row)[0])(ct_GN.astype(jnp.float32))
    codes, scale = quantize_blocks(ct_GBK, grad_bits)  # row j: my part of device j's chunk
    got = jax.lax.all_to_all(codes, axes, 0, 0, tiled=True)  # [G, blocks, K or K/2] int
    got_scale = jax.lax.all_to_all(scale, axes, 0, 0, tiled=True)  # [G, blocks] fp32
    total = jnp.sum(dequantize_blocks(got, got_scale, grad_bits), axis=0).reshape(-1)
    return (total[: ct_GN.shape[1]].astype(ct_GN.dtype),)  # g versions summed in fp32


gather.defvjp(_gather_fwd, _gather_bwd)


def _sharded_dim(spec: P, axes: tuple[str, ...]) -> int | None:
    """The dim split over the batch axes (ZeRO-3's parameter split), or None."""
    for d, entry in enumerate(spec):
        names = entry if isinstance(entry, tuple) else (entry,)
        if any(a in axes for a in names if a):
            if tuple(names) != axes:
                raise ShardingError(
                    f"ZeRO++ gathers parameters over {axes}, but a parameter is split as "
                    f"{spec}. Fix: zero=3 on a mesh of data (and fsdp) axes only."
                )
            return d
    return None


def _hops(spec: P, shape: tuple, *, axes, weight_bits: int, grad_bits: int, dtype):
    """One parameter's gather as two functions, shard -> secondary -> full.

    On a ``data x fsdp`` mesh the first hop gathers across nodes (``data``): its result,
    the weight split over ``fsdp`` only, is hpZ's secondary partition; the second hop
    gathers inside the node. On a single axis the first hop is a cast and the second the
    whole gather. A replicated parameter (no split dim) needs neither.
    """
    d = _sharded_dim(spec, axes)
    if d is None:
        return (lambda x: x.astype(dtype)), (lambda a: a)
    moved = (shape[d], *shape[:d], *shape[d + 1 :])  # [s_d / G, ...rest]
    two = len(axes) == 2

    def first(x):
        flat = jnp.moveaxis(x, d, 0).astype(dtype).reshape(-1)
        return gather(flat, axes[:1], weight_bits, grad_bits) if two else flat  # [D, n] | [n]

    def second(a):
        if two:  # [D, n] -> [F, D n] -> [D, F, n]: data-major order of the shards
            d_, n = a.shape
            full_FDN = gather(a.reshape(-1), axes[1:], weight_bits, grad_bits)
            full_GN = full_FDN.reshape(-1, d_, n).swapaxes(0, 1)
        else:
            full_GN = gather(a, axes, weight_bits, grad_bits)
        return jnp.moveaxis(full_GN.reshape(-1, *moved[1:]), 0, d)

    return first, second


def batch_axes(batch_spec: P) -> tuple[str, ...]:
    """The mesh axes the batch (and ZeRO-3's parameters) split over, outer first."""
    entry = batch_spec[0]
    return tuple(entry) if isinstance(entry, tuple) else ((entry,) if entry else ())


def check(data, mesh_axes, rules) -> None:
    """ZeRO++ needs ZeRO-3 over the batch axes alone; hpZ needs a node factorisation."""
    others = {a: s for a, s in mesh_axes.items() if a not in (Axis.DATA, Axis.FSDP) and s > 1}
    sharded = data.zero == 3 or (Axis.FSDP in mesh_axes and mesh_axes.get(Axis.DATA, 1) == 1)
    problems = [f"mesh axes {others}"] if others else []
    problems += [] if sharded else [f"zero={data.zero} (parameters not sharded)"]
    if data.hpz and not (mesh_axes.get(Axis.DATA, 1) > 1 and mesh_axes.get(Axis.FSDP, 1) > 1):
        problems.append("hpz without a data x fsdp mesh (nodes x devices per node)")
    if problems:
        raise ShardingError(
            "ZeRO++ (quantized_weights / hpz / quantized_gradients) rewrites ZeRO-3's "
            f"collectives, but this plan has {'; '.join(problems)}. Fix: zero=3 on a mesh "
            "data=NODES x fsdp=DEVICES_PER_NODE (hpz) or data=N, with no other axes."
        )


def value_and_grad(plan, loss_fn, layout):
    """``(params, tokens) -> ((loss, metrics), grads)`` with ZeRO++'s collectives (the
    plan's ``data`` settings; ``parallel.gradients`` picks this path).

    ``loss_fn(params, tokens) -> (loss, metrics)`` is the full-model loss; parameters and
    gradients are in their ZeRO-3 layouts (``layout.param_specs``, a
    ``gradients.StepLayout``).

    ZeRO-3 frees gathered weights after forward and gathers them again for backward. Here
    the loss is a ``custom_vjp`` that keeps only the shards (hpZ: the secondary partition)
    and whose backward gathers again and runs the model's forward and backward from there
    (a full recompute: +1 forward of FLOPs). The backward's input is tied to the forward's loss
    by adding ``0 * loss``; XLA would otherwise merge the two identical gathers (it does
    so through ``jax.checkpoint``'s and optimization barriers on CPU, seen with jax 0.10.2).
    """
    data, axes = plan.data, batch_axes(layout.batch_spec)
    n = math.prod(plan.mesh_axes[a] for a in axes)
    opts = dict(
        axes=axes, weight_bits=8 if data.quantized_weights else 0,
        grad_bits=data.gradient_bits if data.quantized_gradients else 0,
        dtype=layout.dtype,
    )  # fmt: skip
    specs, is_spec = layout.param_specs, (lambda s: isinstance(s, P))
    hpz = data.hpz

    def body(params, tokens_BL1):
        hops = jax.tree.map(lambda s, x: _hops(s, x.shape, **opts), specs, params, is_leaf=is_spec)
        is_hop = lambda h: isinstance(h, tuple) and callable(h[0])  # noqa: E731
        first = lambda p: jax.tree.map(lambda h, x: h[0](x), hops, p, is_leaf=is_hop)  # noqa: E731
        second = lambda a: jax.tree.map(lambda h, x: h[1](x), hops, a, is_leaf=is_hop)  # noqa: E731

        def model(full):
            with suspend_layout():
                loss, extra = loss_fn(full, tokens_BL1)
            return loss / n, extra  # the reduce-scatters sum: a mean over devices

        @jax.custom_vjp
        def loss_of_shards(p):
            return model(second(first(p)))

        def fwd(p):
            a = first(p)  # forward gathers (cross-node hop first)
            out = model(second(a))
            return out, (a if hpz else p, out[0])  # hpZ keeps the secondary partition

        def bwd(res, ct):
            kept, loss = res
            # + 0 * loss: a data dependence XLA cannot fold (the loss is only known at run
            # time), so these gathers run after the forward pass instead of being merged
            zero = loss * 0.0
            kept = jax.tree.map(lambda k: k + zero.astype(k.dtype), kept)
            if hpz:  # intra-node gather again, then the cross-node hop's reduce-scatter
                _, vjp_second = jax.vjp(lambda a: model(second(a)), kept)
                _, vjp_first = jax.vjp(first, params)  # primal unused: only its transpose
                return vjp_first(*vjp_second(ct))
            _, vjp = jax.vjp(lambda p: model(second(first(p))), kept)
            return vjp(ct)

        loss_of_shards.defvjp(fwd, bwd)
        (loss, extra), grads = jax.value_and_grad(loss_of_shards, has_aux=True)(params)

        def replicated(s, g):  # no sharded dim: an ordinary all-reduce
            return g if _sharded_dim(s, axes) is not None else jax.lax.psum(g, axes)

        grads = jax.tree.map(replicated, specs, grads, is_leaf=is_spec)
        return (jax.lax.psum(loss, axes), jax.lax.pmean(extra, axes)), grads

    return jax.shard_map(
        body,
        mesh=layout.mesh,
        in_specs=(specs, layout.batch_spec),
        out_specs=((P(), P()), specs),
        check_vma=False,
    )
