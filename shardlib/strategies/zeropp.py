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

from shardlib.compression import dequantize_blocks, quantize_blocks
from shardlib.errors import ShardingError
from shardlib.layout import suspend_layout
from shardlib.mesh import Axis

BLOCK = 256  # elements per quantization block (one fp32 scale each): 1.6% on int8
GATHERED = "zeropp_gathered"  # checkpoint name of the rebuilt weights: never kept


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


def gather_leaf(x, spec: P, *, axes, hpz: bool, weight_bits: int, grad_bits: int, dtype):
    """One parameter from its ZeRO-3 shard to its full shape.

    On a ``data x fsdp`` mesh the gather runs in two hops, across nodes (``data``) then
    inside them (``fsdp``), with or without hpZ: the bytes equal one flat gather's, and each
    axis's share shows. hpZ only decides what the backward pass starts from: the secondary
    partition (after the first hop) is kept, so only the intra-node hop runs again.
    """
    d = _sharded_dim(spec, axes)
    if d is None:
        return x.astype(dtype)
    x0 = jnp.moveaxis(x, d, 0).astype(dtype)  # [s_d / G, ...rest]
    flat = x0.reshape(-1)
    if len(axes) == 2:  # (data, fsdp): cross-node hop, then intra-node hop
        secondary_DN = gather(flat, axes[:1], weight_bits, grad_bits)  # [D, n]
        if not hpz:  # plain ZeRO-3: the backward pass gathers across nodes again
            secondary_DN = jax.ad_checkpoint.checkpoint_name(secondary_DN, GATHERED)
        inner_FDN = gather(secondary_DN.reshape(-1), axes[1:], weight_bits, grad_bits)
        f, dn = inner_FDN.shape
        full_GN = inner_FDN.reshape(f, dn // flat.size, flat.size).swapaxes(0, 1)
    else:
        full_GN = gather(flat, axes, weight_bits, grad_bits)
    full = full_GN.reshape(-1, *x0.shape[1:])
    return jax.ad_checkpoint.checkpoint_name(jnp.moveaxis(full, 0, d), GATHERED)


def batch_axes(setup) -> tuple[str, ...]:
    """The mesh axes the batch (and ZeRO-3's parameters) split over, outer first."""
    entry = setup.batch_sharding.spec[0]
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


def value_and_grad(setup, loss_fn):
    """``(params, tokens) -> ((loss, metrics), grads)`` with ZeRO++'s collectives.

    ``loss_fn(params, tokens) -> (loss, metrics)`` is the full-model loss; parameters and
    gradients are in their ZeRO-3 layouts (``setup.param_specs``).
    """
    data, axes = setup.plan.data, batch_axes(setup)
    n = math.prod(setup.plan.mesh_axes[a] for a in axes)
    w_bits = 8 if data.quantized_weights else 0
    g_bits = data.gradient_bits if data.quantized_gradients else 0
    specs = setup.param_specs
    leaf = partial(
        gather_leaf, axes=axes, hpz=data.hpz, weight_bits=w_bits, grad_bits=g_bits,
        dtype=setup.compute_dtype,
    )  # fmt: skip
    is_spec = lambda s: isinstance(s, P)  # noqa: E731

    def body(params, tokens_BL1):
        def local(p):
            full = jax.tree.map(lambda s, x: leaf(x, s), specs, p, is_leaf=is_spec)
            with suspend_layout():
                loss, extra = loss_fn(full, tokens_BL1)
            return loss / n, extra  # the reduce-scatters sum: a mean over devices

        policy = jax.checkpoint_policies.save_anything_except_these_names(GATHERED)
        grad_fn = jax.value_and_grad(jax.checkpoint(local, policy=policy), has_aux=True)
        (loss, extra), grads = grad_fn(params)

        def replicated(s, g):  # no sharded dim: an ordinary all-reduce
            return g if _sharded_dim(s, axes) is not None else jax.lax.psum(g, axes)

        grads = jax.tree.map(replicated, specs, grads, is_leaf=is_spec)
        return (jax.lax.psum(loss, axes), jax.lax.pmean(extra, axes)), grads

    return jax.shard_map(
        body,
        mesh=setup.mesh,
        in_specs=(specs, setup.batch_sharding.spec),
        out_specs=((P(), P()), specs),
        check_vma=False,
    )
