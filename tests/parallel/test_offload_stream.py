"""ZeRO-Offload's streamed update and parameter offload: the same training, less device memory.

* ``streamed_update`` equals optax's whole update (unit, one small jit);
* non-elementwise optimizers are refused before compiling;
* the train step with offloaded optimizer state, weights, or both trains like the one-device
  run without offload (parity, fp32);
* device bytes of the compiled step, by memory kind (``analysis.memory_kinds``: the CPU
  backend reports every kind together, so host bytes come from the ``S(5)`` entry layouts
  and the staged copies from the jaxpr): optimizer offload frees at least 90% of the
  optimizer state's bytes and all but two layers' worth of the blocks' gradients (sent to
  host memory by the backward); parameter offload stages one layer's weights per trip of
  the forward and backward loops.
"""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import SingleDeviceSharding

from shardlib import ShardingError, mesh_spec
from shardlib.analysis.memory_kinds import loop_staged, memory_by_kind
from shardlib.core.mesh import single_device_mesh
from shardlib.parallel.offload_stream import streamed_update
from shardlib.tools import parity
from shardlib.train.config import override, train_config
from shardlib.train.optim import decay_mask
from shardlib.train.setup import make_setup

CFG = train_config(steps=3, batch=8, seq=16, clip_norm=0.5, **{"model.layers": 2})


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.slow  # the fast subset keeps the inner loop under 3 minutes
def test_streamed_update_equals_optax_whole_update():
    keys = iter(jax.random.split(jax.random.key(0), 8))
    shapes = {"blocks": {"w": (3, 4, 5), "norm": {"scale": (3, 4)}}, "embedding": (6, 4)}
    params = jax.tree.map(lambda s: jax.random.normal(next(keys), s), shapes,
                          is_leaf=lambda s: isinstance(s, tuple))  # fmt: skip
    grads = jax.tree.map(lambda p: 3 * jax.random.normal(next(keys), p.shape), params)
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask)
    )
    host = SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    state = tx.update(grads, tx.init(params), params)[1]  # count = 1, moments not 0

    def whole(g, s, p):
        updates, new_state = tx.update(g, s, p)
        return optax.apply_updates(p, updates), new_state

    def streamed(g, s, p):
        return streamed_update(tx, g, s, p, layers=3, clip_norm=1.0)[:2]

    want = jax.jit(whole)(grads, state, params)
    device = SingleDeviceSharding(jax.devices()[0])
    step = jax.jit(streamed, in_shardings=(device, host, device), out_shardings=(device, host),
                   donate_argnums=1)  # fmt: skip
    got = step(grads, jax.device_put(state, host), params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(got[1]) if x.ndim} == {"pinned_host"}


def test_a_streamed_update_refuses_optimizers_that_are_not_elementwise():
    cfg = override(CFG, {"optimizer": "lamb", "offload_optimizer": True})
    with pytest.raises(ShardingError, match="offload_per_layer=false"):
        make_setup(cfg, single_device_mesh())
    make_setup(override(cfg, {"offload_per_layer": False}), single_device_mesh())


# Optimizer offload alone is ``streamed_update`` with the weights on the device: the unit
# test above; here the weights and their gradients stream too (host-memory rows).
@pytest.mark.slow
@pytest.mark.parametrize("params", [True, False], ids=["weights", "gradients-in-backward"])
def test_offloaded_training_matches_the_one_device_run(params):
    """Weights offloaded (their gradients host memory as the transpose of the fetch), or on
    the device with their gradients sent to host memory by the backward (``offload_grads``)."""
    offload = {"offload_optimizer": True, "offload_params": params}
    setup = make_setup(override(CFG, offload), single_device_mesh())
    got = parity.trace(setup, parity.random_state(setup), grads=False, params=True)
    result = parity.compare_traces(got, parity.one_device(CFG))
    assert result.ok(), result  # losses, gradient norms, final parameters: rel err <= 1e-5
    assert {x.sharding.memory_kind for x in jax.tree.leaves(got.state["opt_state"]) if x.ndim} == {
        "pinned_host"
    }


@pytest.mark.slow
def test_offload_frees_device_memory_by_kind():
    """32 layers: one layer's optimizer state is 1/32 of the stacked state."""
    cfg = override(CFG, {"model.layers": 32, "batch": 4})

    def measure(**settings):
        setup = make_setup(override(cfg, settings), single_device_mesh())
        state, batch = setup.abstract_state(), setup.abstract_batch()
        return state, memory_by_kind(setup.train_step, state, batch)

    state, plain = measure()
    _, offloaded = measure(offload_optimizer=True)
    state_bytes = _nbytes(state["opt_state"])
    print("no offload:", plain.formula())
    print("optimizer offload:", offloaded.formula(), f"(optimizer state {state_bytes:,})")
    assert offloaded.host_bytes == state_bytes  # all of it lives in host memory
    # and the blocks' gradients, which the backward writes to host memory layer by layer
    # (``offload_grads``): the device holds one layer's instead of 32
    grads = _nbytes(state["params"]["blocks"])
    print(f"blocks' gradients {grads:,}, in host memory {offloaded.host_temp_bytes:,}")
    assert offloaded.host_temp_bytes == grads
    freed = plain.device_bytes - offloaded.device_bytes
    assert freed >= 0.9 * state_bytes + grads * (1 - 2 / 32)  # a layer's in backward and update

    # parameter offload, from the program (traced, not compiled: benchmarks/offload_tiers.py
    # prints its compiled bytes): each trip of the forward and the backward layer loop
    # fetches one layer's weights, the update's trip a layer's weights and gradients
    setup = make_setup(override(cfg, {"offload_params": True}), single_device_mesh())
    state = setup.abstract_state()
    layer = _nbytes(state["params"]["blocks"]) // setup.workload.blocks
    loops = loop_staged(setup.train_step.trace(state, setup.abstract_batch()).jaxpr.jaxpr)
    print("parameter offload, per loop trip:", loops, f"(one layer {layer:,})")
    forward, backward = loops[0][1], loops[1][1]
    assert forward == backward == layer
    assert max(b for _, b in loops) <= 2 * layer


@pytest.mark.slow
def test_host_gradients_are_counted_as_one_device_holds_them():
    """On a mesh the host values' avals read replicated; the gradients a device writes to
    host memory are its shard of the blocks' (tensor 4 splits them four ways), as the
    weights are laid out (``memory_kinds.weight_splits``). Counted whole, the validation
    of a ZeRO-1 offload plan on data 16 x tensor 4 subtracted 16.0 MB where a device
    writes 4.0 and read 1.407 of compiled (1.102 counted per device)."""
    from shardlib.analysis.memory_kinds import host_temp_bytes, live, weight_splits

    cfg = override(CFG, {"model": "llama-small", "model.kv_heads": 8, "batch": 16, "seq": 64})
    mesh = mesh_spec(data=2, tensor=4).build(jax.devices()[:8])
    setup = make_setup(override(cfg, {"offload_optimizer": True, "zero": 1}), mesh)
    state, batch = setup.abstract_state(), setup.abstract_batch()
    jaxpr = live(setup.train_step.trace(state, batch).jaxpr.jaxpr)
    blocks = jax.tree.leaves(state["params"]["blocks"])
    shard = sum(np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in blocks)
    assert shard < _nbytes(blocks)  # split over tensor
    assert host_temp_bytes(jaxpr, weight_splits(state["params"])) == shard
