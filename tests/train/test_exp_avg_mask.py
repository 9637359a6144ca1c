"""DeepSpeed's ``exp_avg_mask`` for 1-bit Adam and 1-bit LAMB (``train/onebit.py``).

DeepSpeed's OnebitAdam and OnebitLamb multiply the momentum by the parameter group's
``exp_avg_mask`` right after each compressed all-reduce: sign codes cannot say 0, so rows
whose gradient is always 0 (BERT's position embeddings past the trained length) collect
compression error in their momentum unless masked. Checked on a tiny tree over data=2
(compile only of a small shard_map): warm-up for 1 step, then compressed steps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardlib
from shardlib.core.errors import ShardingError
from shardlib.train.config import train_config
from shardlib.train.onebit import scale_by_onebit_adam
from shardlib.train.onebit_lamb import scale_by_onebit_lamb
from shardlib.train.setup import make_setup

ROWS = 4  # rows 4.. of "a" never get a gradient (positions past the trained length)


def _params():
    key = jax.random.key(0)
    return {"a": jax.random.normal(key, (8, 4)), "b": jax.random.normal(key, (16,)) + 2.0}


def _grads(t):  # [2 devices, ...]: each device's own gradient
    key = jax.random.key(t + 1)
    a = jax.random.normal(key, (2, 8, 4)).at[:, ROWS:].set(0.0)
    return {"a": a, "b": jax.random.normal(jax.random.fold_in(key, 1), (2, 16))}


MASK = {"a": jnp.ones((8, 4)).at[ROWS:].set(0.0), "b": 1.0}


def _momenta(name):
    """The momentum after each of 3 steps without and with ``MASK`` (one program for both)."""
    txs = []
    for exp_avg_mask in (None, MASK):
        common = dict(b1=0.9, b2=0.999, freeze_step=1, n=2, steps=3, exp_avg_mask=exp_avg_mask)
        if name == "adam":
            txs.append(scale_by_onebit_adam(eps=1e-8, **common))
        else:
            txs.append(scale_by_onebit_lamb(eps=1e-6, weight_decay=0.0, mask=None, **common))
    mesh = shardlib.mesh_spec(data=2).build(jax.devices()[:2])
    params = (_params(), _params())
    states = tuple(tx.init(p) for tx, p in zip(txs, params, strict=True))
    spec = jax.tree.map(lambda _: P(), states[0])._replace(worker_error=P("data"),
                                                           server_error=P("data"))  # fmt: skip

    def one(grads, states, params):
        local = jax.tree.map(lambda g: g[0], grads)
        out = [tx.update(local, s, p) for tx, s, p in zip(txs, states, params, strict=True)]
        return tuple(u for u, _ in out), tuple(s for _, s in out)

    grad_specs = jax.tree.map(lambda _: P("data"), params[0])
    step = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(grad_specs, (spec, spec), P()),
                                 out_specs=(P(), (spec, spec)), check_vma=False))  # fmt: skip
    mu = (lambda s: s.mu) if name == "adam" else (lambda s: s.adam.mu)
    out = ([], [])
    for t in range(3):
        updates, states = step(_grads(t), states, params)
        params = jax.tree.map(lambda w, u: w - 0.01 * u, params, updates)
        for kept, state in zip(out, states, strict=True):
            kept.append(jax.device_get(mu(state)))
    return out


@pytest.mark.slow  # one small shard_map compile each (about 5 s on 2 shared cores)
@pytest.mark.parametrize("name", ["adam", "lamb"])
def test_mask_zeroes_the_compressed_momentum_where_deepspeed_does(name):
    plain, masked = _momenta(name)
    # warm-up (step 0): the fp32 average, no mask (DeepSpeed masks the compressed stage only)
    np.testing.assert_array_equal(masked[0]["a"], plain[0]["a"])
    assert not plain[0]["a"][ROWS:].any()  # exact zeros while averaged in fp32
    # the first compressed step: 1-bit codes put error into the rows with no gradient ...
    assert np.abs(plain[1]["a"][ROWS:]).min() > 0
    # ... which the mask removes, after the all-reduce: the rest is exactly the unmasked run's
    np.testing.assert_array_equal(masked[1]["a"], plain[1]["a"] * np.asarray(MASK["a"]))
    np.testing.assert_array_equal(masked[1]["b"], plain[1]["b"])
    assert not masked[2]["a"][ROWS:].any()


def test_setup_takes_a_mask_and_refuses_a_bad_one_before_compiling():
    mesh = shardlib.mesh_spec(data=2).build(jax.devices()[:2])
    small = {"model.layers": 1, "model.embed": 32, "model.heads": 4, "model.kv_heads": 2,
             "model.head_dim": 8, "model.mlp": 64}  # fmt: skip
    cfg = train_config(optimizer="onebit_adam", freeze_step=1, batch=4, seq=8, steps=2, **small)
    setup = make_setup(cfg, mesh)
    ones = jax.tree.map(lambda p: jnp.ones(p.shape), setup.param_shapes)
    table = setup.param_shapes["embedding"].shape  # [vocab, embed]
    mask = {**ones, "embedding": jnp.ones(table).at[table[0] // 2 :].set(0.0)}
    masked = setup.with_exp_avg_mask(mask)
    assert masked.tx is not setup.tx and masked.param_shapes is setup.param_shapes
    with pytest.raises(ShardingError, match=r"exp_avg_mask\['embedding'\].*Fix"):
        setup.with_exp_avg_mask({**ones, "embedding": jnp.ones((3,))})
    with pytest.raises(ShardingError, match="tree"):
        setup.with_exp_avg_mask({"embedding": 1.0})
    adamw = make_setup(train_config(optimizer="adamw", batch=4, seq=8, steps=2, **small), mesh)
    with pytest.raises(ShardingError, match="onebit_adam or onebit_lamb"):
        adamw.with_exp_avg_mask(ones)
