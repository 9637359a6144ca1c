"""1-bit Adam (Tang et al. 2021): Adam whose momentum crosses the data axis as sign bits.

Adam's variance stabilises early in training. 1-bit Adam runs full Adam for ``freeze_step``
steps (warm-up: the gradient is all-reduced in fp32), then freezes the variance and stops
all-reducing gradients. Each worker folds its *local* gradient into its momentum and the
momenta are averaged by a compressed all-reduce (``compressed_allreduce``, Alg. 1 of the
paper, DeepSpeed's ``NcclBackend.compressed_allreduce``):

1. worker: add the worker error, split the flat momentum into N chunks (one per server),
   compress each to packed signs + one fp32 scale, keep what was lost as the new error;
2. all-to-all: server j receives chunk j of every worker (uint8 on the wire);
3. server: average the decompressed chunks, add the server error, compress again;
4. all-gather: every worker receives every server's compressed average (uint8 again).

Bytes per device after warm-up: an all-to-all and an all-gather of Ψ/8 bytes, i.e.
2(N-1)/N · Ψ/8 against the fp32 all-reduce's 2(N-1)/N · 4Ψ: 1/32, plus 2N fp32 scales.

The transform (``scale_by_onebit_adam``) is an optax ``GradientTransformation`` whose
``update`` must run inside ``shard_map`` over the data axis on *local* gradients: the
communication is part of the update. ``build_onebit_step`` is that step. Error buffers differ
per device, so they are stored sharded over the data axis (``error_specs``); momentum and
variance are the same on every device after each step and stay replicated (plain data
parallelism, ZeRO-0, as in DeepSpeed, where 1-bit Adam does not combine with ZeRO).

What selects all this is the plan's ``parallel.data.onebit_momentum``, a data-parallel
communication setting: ``optimizer=onebit_adam`` is AdamW with it set, ``onebit_lamb`` LAMB
(``optim.SPELLINGS``; 1-bit LAMB's update is ``train/onebit_lamb.py``).
The plan refuses the layouts it cannot run on (``parallel.gradients.check``) and its gradient
path gives the step each device's own gradient (``parallel.gradients``).

0/1 Adam (Lu et al. 2022) is not offered: its local steps let the parameters of different
workers drift apart between synchronisations, which the one-logical-array-per-parameter
state layout cannot express (it would need per-worker parameter copies, [N, ...] sharded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import PartitionSpec as P

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import Axis
from shardlib.parallel.compression import onebit_compress, onebit_decompress

if TYPE_CHECKING:
    from shardlib.train.setup import TrainSetup

AXIS = Axis.DATA


class OneBitAdamState(NamedTuple):
    """Adam's moments plus the two error-feedback buffers."""

    count: jax.Array  # [] int32: steps taken
    mu: Any  # like params: momentum (replicated)
    nu: Any  # like params: variance (replicated; frozen after warm-up)
    worker_error: jax.Array  # [N * P] fp32 global, [P] per device: what this worker lost
    server_error: jax.Array  # [P] fp32 global, [P / N] per device: what its server chunk lost


def padded_size(params, n: int) -> int:
    """Flat parameter count rounded up to whole bytes of signs in each of n chunks."""
    size = sum(x.size for x in jax.tree.leaves(params))
    return -(-size // (8 * n)) * 8 * n


def compressed_allreduce(x_P, worker_error_P, server_error_K, *, axis: str, n: int):
    """Mean of ``x`` over ``axis`` through 1-bit codes with error feedback (inside shard_map).

    ``x`` [P] local, P = n·K with K a multiple of 8. Returns (mean [P], new worker error [P],
    new server error [K]). Only uint8 codes and fp32 scales cross the axis.
    """
    k = x_P.shape[0] // n
    c_NK = (x_P + worker_error_P).reshape(n, k)  # chunk j goes to server j
    packed_NB, scale_N, werr_NK = onebit_compress(c_NK)
    # server side: chunk (this device's index) of every worker
    got_NB = jax.lax.all_to_all(packed_NB, axis, 0, 0, tiled=True)  # [n, K/8] uint8
    got_scale_N = jax.lax.all_to_all(scale_N, axis, 0, 0, tiled=True)  # [n] fp32
    mean_K = jnp.mean(onebit_decompress(got_NB, got_scale_N), axis=0) + server_error_K
    s_packed_1B, s_scale_1, serr_1K = onebit_compress(mean_K[None])
    # every worker gets every server's averaged chunk
    all_NB = jax.lax.all_gather(s_packed_1B[0], axis, tiled=False)  # [n, K/8] uint8
    all_scale_N = jax.lax.all_gather(s_scale_1[0], axis)  # [n] fp32
    mean_P = onebit_decompress(all_NB, all_scale_N).reshape(-1)
    return mean_P, werr_NK.reshape(-1), serr_1K[0]


def apply_exp_avg_mask(mu, exp_avg_mask):
    """DeepSpeed's ``exp_avg_mask``: the averaged momentum of the compressed stage times a
    mask (OnebitAdam / OnebitLamb multiply ``exp_avg`` by it right after the compressed
    all-reduce). Signs cannot encode 0, so a momentum that should stay exactly 0 (BERT's
    position embeddings past the trained length) would otherwise collect compression error.
    ``exp_avg_mask``: None, or a tree like the parameters of arrays broadcastable to them."""
    if exp_avg_mask is None:
        return mu
    return jax.tree.map(lambda m, k: m * jnp.asarray(k, m.dtype), mu, exp_avg_mask)


def check_exp_avg_mask(exp_avg_mask, params) -> None:
    """The mask's tree and shapes against the parameters', before anything is compiled."""
    if exp_avg_mask is None:
        return
    want, got = jax.tree.structure(params), jax.tree.structure(exp_avg_mask)
    if want != got:
        raise ShardingError(
            f"exp_avg_mask: its tree {got} is not the parameters' {want}. Fix: build it "
            "with jax.tree.map(lambda p: 1.0, params) and set the masked entries."
        )
    for path, p, k in zip(
        jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(params),
        jax.tree.leaves(exp_avg_mask), strict=True,
    ):  # fmt: skip
        shape = jnp.shape(k)
        try:
            jnp.broadcast_shapes(shape, p.shape)
        except ValueError:
            name = jax.tree_util.keystr(path[0])
            raise ShardingError(
                f"exp_avg_mask{name}: shape {shape} does not broadcast to the parameter's "
                f"{p.shape}. Fix: a mask of shape {p.shape} (or 1.0 for no mask)."
            ) from None


def scale_by_onebit_adam(
    *, b1: float, b2: float, eps: float, freeze_step: int, n: int, steps: int,
    bias_correction: bool = True, axis: str = AXIS, exp_avg_mask=None,
) -> optax.GradientTransformation:  # fmt: skip
    """Adam's direction ``m̂ / (sqrt(v̂) + eps)`` with 1-bit momentum averaging after
    ``freeze_step`` steps. ``update`` takes each device's *local* gradient inside shard_map
    over ``axis`` (size ``n``). A run of at most ``freeze_step`` steps never compresses, and
    its program holds only the fp32 path (equal to optax.adam on the averaged gradient).
    ``exp_avg_mask`` multiplies the averaged momentum of each compressed step
    (``apply_exp_avg_mask``)."""

    def init(params):
        p = padded_size(params, n)
        zeros = jax.tree.map(jnp.zeros_like, params)
        return OneBitAdamState(
            count=jnp.zeros((), jnp.int32),
            mu=zeros,
            nu=jax.tree.map(jnp.zeros_like, params),
            worker_error=jnp.zeros((n * p,), jnp.float32),
            server_error=jnp.zeros((p,), jnp.float32),
        )

    def exact(grads, state):
        g = jax.lax.pmean(grads, axis)  # warm-up: the fp32 all-reduce
        mu = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, state.mu, g)
        nu = jax.tree.map(lambda v, x: b2 * v + (1 - b2) * jnp.square(x), state.nu, g)
        return mu, nu, state.worker_error, state.server_error

    def compressed(grads, state):
        local = jax.tree.map(lambda m, x: b1 * m + (1 - b1) * x, state.mu, grads)
        flat, unravel = ravel_pytree(local)
        pad = state.worker_error.shape[0] - flat.shape[0]
        x_P = jnp.pad(flat.astype(jnp.float32), (0, pad))
        mean_P, werr, serr = compressed_allreduce(
            x_P, state.worker_error, state.server_error, axis=axis, n=n
        )
        mu = apply_exp_avg_mask(unravel(mean_P[: flat.shape[0]]), exp_avg_mask)
        return mu, state.nu, werr, serr

    def update(grads, state, params=None):
        del params
        if freeze_step >= steps:
            mu, nu, werr, serr = exact(grads, state)
        elif freeze_step == 0:
            mu, nu, werr, serr = compressed(grads, state)
        else:
            mu, nu, werr, serr = jax.lax.cond(
                state.count < freeze_step, exact, compressed, grads, state
            )
        count = state.count + 1
        if bias_correction:
            frozen = jnp.minimum(count, max(freeze_step, 1)) if freeze_step < steps else count
            mu_hat = optax.tree.bias_correction(mu, b1, count)
            nu_hat = optax.tree.bias_correction(nu, b2, frozen)
        else:
            mu_hat, nu_hat = mu, nu
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        return updates, OneBitAdamState(count, mu, nu, werr, serr)

    return optax.GradientTransformation(init, update)


def error_specs(opt_state_specs, abstract_opt_state):
    """The optimizer-state specs with the error buffers split over the data axis (each
    device keeps its own); everything else as ``layouts.opt_state_specs`` laid it out."""

    def fix(spec, state):
        if is_state(state):
            return spec._replace(worker_error=P(AXIS), server_error=P(AXIS))
        return spec

    def is_state(x):  # 1-bit Adam's state, or 1-bit LAMB's (train/onebit_lamb.py)
        return isinstance(x, tuple) and hasattr(x, "worker_error") and hasattr(x, "_replace")

    return jax.tree.map(fix, opt_state_specs, abstract_opt_state, is_leaf=is_state)


def build_onebit_step(setup: TrainSetup, loss_fn):
    """The train step under ``parallel.data.onebit_momentum``: the whole step in shard_map
    over ``data``, so that the plan's gradient path yields each device's own gradient (its
    1-bit case) and only the optimizer's compressed collectives cross the axis.

    ``grad_norm`` is the root mean square over workers of the local gradient norms: the
    averaged gradient is never formed after warm-up. With fp16 the loss scaler skips a step
    when any worker's gradient overflowed (one boolean all-reduce).
    """
    from shardlib.train import precision

    tx, sched, cfg, plan = setup.tx, setup.schedule, setup.cfg, setup.plan
    scaled = precision.uses_loss_scale(cfg.precision)
    specs = jax.tree.map(lambda s: s.spec, setup.state_shardings)
    batch_spec = jax.tree.map(lambda s: s.spec, setup.batch_sharding)  # a user's: a tree

    def local(state, tokens_BL1):
        params = state["params"]
        scale = state["loss_scale"]["scale"] if scaled else 1.0
        grad_fn = plan.value_and_grad(
            loss_fn, setup.step_layout, has_aux=True, loss_scale=scale if scaled else None
        )
        (loss, extra), grads = grad_fn(params, tokens_BL1)
        grads = jax.tree.map(lambda g: g / scale, grads)
        updates, new_opt = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        sq = sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads))
        metrics = {
            "loss": jax.lax.pmean(loss / scale, AXIS),
            "grad_norm": jnp.sqrt(jax.lax.pmean(sq, AXIS)),
            "lr": sched(state["step"]),
            **jax.lax.pmean(extra, AXIS),
        }
        new_state = {"params": new_params, "opt_state": new_opt, "step": state["step"] + 1}
        if scaled:
            finite = jax.lax.pmin(precision.all_finite(grads).astype(jnp.int32), AXIS) > 0
            new_state["params"] = precision.keep_if(finite, new_params, params)
            new_state["opt_state"] = precision.keep_if(finite, new_opt, state["opt_state"])
            ls = precision.update_loss_scale(cfg.precision, state["loss_scale"], finite)
            new_state["loss_scale"] = ls
            metrics.update(precision.metrics(ls, finite))
        return new_state, metrics

    step = jax.shard_map(
        local,
        mesh=setup.mesh,
        in_specs=(specs, batch_spec),
        out_specs=(specs, P()),
        check_vma=False,
    )
    return jax.jit(
        step,
        in_shardings=(setup.state_shardings, setup.batch_sharding),
        out_shardings=(setup.state_shardings, None),
        donate_argnums=0,
    )
