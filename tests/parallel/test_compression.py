"""Compressed communication: 1-bit codes with error feedback, 1-bit Adam, ZeRO++.

One small model (1 layer, width 32) on 8 simulated devices. Every compiled program is
checked twice: its numbers (parity or closeness) and its optimized HLO (the collectives
carry uint8 / int8 with the bytes the papers' formulas give).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardlib
from benchmarks.comm_compression import collective_bytes
from shardlib.core.errors import ShardingError
from shardlib.parallel.compression import (
    dequantize_blocks,
    onebit_compress,
    onebit_decompress,
    pack_signs,
    quantize_blocks,
    unpack_signs,
)
from shardlib.tools.parity import one_device, random_state, trace
from shardlib.train.config import train_config
from shardlib.train.onebit import compressed_allreduce, padded_size
from shardlib.train.setup import make_setup

SMALL = {"model.layers": 1, "model.embed": 32, "model.heads": 4, "model.kv_heads": 2,
         "model.head_dim": 8, "model.mlp": 64}  # fmt: skip
BASE = dict(batch=16, seq=16, steps=3, schedule="constant", lr=1e-2, weight_decay=0.0,
            clip_norm=0.0, **SMALL)  # fmt: skip


def test_codes_round_trip_and_keep_what_they_lose():
    @jax.jit  # one compile for every code
    def codes(x):
        packed, scale, err = onebit_compress(x)
        q = {bits: quantize_blocks(x, bits) for bits in (8, 4)}
        back = {bits: dequantize_blocks(*q[bits], bits) for bits in (8, 4)}
        signs = unpack_signs(pack_signs(x))
        return signs, packed, onebit_decompress(packed, scale) + err, q, back

    x = jax.random.normal(jax.random.key(0), (4, 64))
    signs, packed, rebuilt, q, back = codes(x)
    assert np.array_equal(signs, np.where(x >= 0, 1.0, -1.0))
    assert packed.dtype == jnp.uint8 and packed.shape == (4, 8)
    np.testing.assert_allclose(rebuilt, x, atol=1e-6)  # code + error = input
    for bits, width in ((8, 64), (4, 32)):
        c, s = q[bits]
        assert c.shape == (4, width)  # int4: two codes per byte
        assert np.all(np.abs(back[bits] - x) <= s[:, None] / 2 + 1e-6)
        assert np.allclose(s, np.abs(x).max(-1) / (2 ** (bits - 1) - 1))


def test_compressed_allreduce_error_feedback_and_its_uint8_collectives():
    """Fed the same inputs every step, the 1-bit mean is wrong each time, but error
    feedback makes its running average converge to the exact mean."""
    mesh = shardlib.mesh_spec(data=8).build(jax.devices()[:8])
    n, size = 8, 8 * 8 * 16  # P = n chunks of K = 128 (16 bytes of signs each)

    def body(x, w, s):  # this device's [1, P] input and worker error, [P / n] server error
        mean, worker_error, server_error = compressed_allreduce(x[0], w[0], s, axis="data", n=n)
        return mean[None], worker_error[None], server_error

    spec = P("data")
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=(spec,) * 3))
    x = jax.random.normal(jax.random.key(1), (n, size))
    w, s = jnp.zeros((n, size)), jnp.zeros((size,))
    step = step.lower(x, w, s).compile()
    exact = np.asarray(x.mean(0))
    outs = []
    for _ in range(30):
        m, w, s = step(x, w, s)
        outs.append(np.asarray(m[0]))
    err = lambda k: np.linalg.norm(np.mean(outs[:k], 0) - exact) / np.linalg.norm(exact)  # noqa: E731
    assert np.allclose(m[0], m[3])  # every worker gets the same mean
    # the running average converges: the error buffers hold what each step lost
    assert err(1) > 0.3 and err(30) < 0.25 * err(1) and err(30) < 0.6 * err(10), (
        err(1),
        err(10),
        err(30),
    )
    found = collective_bytes(step.as_text(), mesh)
    assert found[("all-to-all", "u8")]["buffer_bytes"] == size // 8  # signs of P
    assert found[("all-gather", "u8")]["buffer_bytes"] == size // 8
    assert ("all-reduce", "f32") not in found  # no full-precision sum


def test_layouts_the_compressed_paths_do_not_cover_are_refused():
    with pytest.raises(ShardingError, match="onebit_adam.*zero=1.*Fix"):
        make_setup(train_config(optimizer="onebit_adam", zero=1, **BASE),
                   shardlib.mesh_spec(data=8).build(jax.devices()[:8]))  # fmt: skip
    with pytest.raises(ShardingError, match="ZeRO\\+\\+.*hpz without a data x fsdp.*Fix"):
        make_setup(train_config(zero=3, hpz=True, **BASE),
                   shardlib.mesh_spec(data=8).build(jax.devices()[:8]))  # fmt: skip


def test_onebit_adam_is_adamw_with_the_data_axis_setting():
    """``optimizer=onebit_adam`` (DeepSpeed's spelling) is AdamW plus the data-parallel
    setting ``onebit_momentum``: the same plan, optimizer state and error-buffer layout;
    the setting needs an Adam momentum to exchange."""
    mesh = shardlib.mesh_spec(data=8).build(jax.devices()[:8])
    named = make_setup(train_config(optimizer="onebit_adam", **BASE), mesh)
    setting = make_setup(train_config(optimizer="adamw", onebit_momentum=True, **BASE), mesh)
    for setup in (named, setting):
        assert setup.plan.data.onebit_momentum
        is_state = lambda x: hasattr(x, "worker_error")  # noqa: E731
        errors = next(
            x for x in jax.tree.leaves(setup.opt_state_shardings, is_leaf=is_state) if is_state(x)
        )
        assert errors.worker_error.spec == P("data") and errors.server_error.spec == P("data")
    shapes = [jax.tree.structure(s._abstract_opt_state) for s in (named, setting)]
    assert shapes[0] == shapes[1]
    plain = make_setup(train_config(optimizer="adamw", **BASE), mesh)
    assert not plain.plan.data.onebit_momentum
    with pytest.raises(ShardingError, match="onebit_momentum.*optimizer=sgd.*Fix"):
        make_setup(train_config(optimizer="sgd", onebit_momentum=True, **BASE), mesh)


@pytest.fixture(scope="module")
def one_device_adam():
    """The reference: plain Adam on one device from ``random_state`` (3 steps)."""
    return one_device(train_config(optimizer="adam", **BASE))


@pytest.mark.slow
def test_onebit_adam_exact_warmup_then_uint8_momentum(one_device_adam):
    """Step 1 is warm-up (fp32 all-reduce, exact Adam): the loss after it equals one-device
    Adam's. Steps 2-3 compress: the program's only large collectives besides the warm-up
    all-reduce are the uint8 all-to-all and all-gather of the packed momentum, Ψ/8 bytes."""
    mesh = shardlib.mesh_spec(data=8).build(jax.devices()[:8])
    setup = make_setup(train_config(optimizer="onebit_adam", freeze_step=1, **BASE), mesh)
    got = trace(setup, random_state(setup), grads=False)
    ref = one_device_adam.losses
    pairs = zip(got.losses[:2], ref[:2], strict=True)
    assert max(abs(a - b) / abs(b) for a, b in pairs) <= 1e-5
    # the compressed step ran (after one warm-up step the variance is far from settled, so
    # its loss is no test of convergence: benchmarks/comm_compression.py runs the curves)
    assert np.isfinite(got.losses[2]) and got.losses[2] != ref[2]
    compiled = setup.train_step.lower(setup.abstract_state(), setup.abstract_batch()).compile()
    found = collective_bytes(compiled.as_text(), mesh)
    p = padded_size(setup.param_shapes, 8)
    assert found[("all-to-all", "u8")]["buffer_bytes"] == p // 8
    assert found[("all-gather", "u8")]["buffer_bytes"] == p // 8
    # the warm-up branch's gradient all-reduce, 32x the compressed bytes
    assert found[("all-reduce", "f32")]["buffer_bytes"] >= 4 * sum(
        x.size for x in jax.tree.leaves(setup.param_shapes)
    )


@pytest.mark.slow
def test_zeropp_exact_parity_quantized_closeness_and_bytes():
    """hpZ alone is exact: first-step gradients equal one device's, and its backward pass
    gathers inside nodes only. qwZ + qgZ (int4, summed
    over 8 devices after two quantized hops): within 35%;
    weights cross as int8 and gradients as packed int4, a quarter of fp32 bytes."""
    from shardlib.dataset.tokens import global_batch, load_tokens
    from shardlib.parallel import zeropp
    from shardlib.tools.parity import first_grads
    from shardlib.train.step import make_loss_fn

    mesh = shardlib.mesh_spec(data=2, fsdp=4).build(jax.devices()[:8])
    ref = make_setup(train_config(optimizer="adam", **BASE),
                     shardlib.mesh_spec(data=1).build(jax.devices()[:1]))  # fmt: skip
    params = random_state(ref)["params"]
    want = first_grads(ref, params)
    grads, found = {}, {}
    for name, parts in (("hpz", {}), ("all", {"quantized_weights": True,
                                              "quantized_gradients": True})):  # fmt: skip
        s = make_setup(train_config(optimizer="adam", zero=3, hpz=True, **parts, **BASE), mesh)
        loss_fn = make_loss_fn(s, with_metrics=True)
        fn = jax.jit(zeropp.value_and_grad(s.plan, loss_fn, s.step_layout))
        tokens = global_batch(load_tokens(None), 0, 16, 16, 0, s.batch_sharding)
        compiled = fn.lower(jax.device_put(params, s.param_shardings), tokens).compile()
        grads[name] = jax.device_get(compiled(jax.device_put(params, s.param_shardings), tokens)[1])
        found[name] = collective_bytes(compiled.as_text(), mesh)
    rel = lambda g, e: np.linalg.norm(g - e) / np.linalg.norm(e)  # noqa: E731
    flat = lambda t: jax.tree.leaves(t)  # noqa: E731
    assert max(rel(g, e) for g, e in zip(flat(grads["hpz"]), flat(want), strict=True)) <= 1e-5
    assert max(rel(g, e) for g, e in zip(flat(grads["all"]), flat(want), strict=True)) <= 0.35
    q, e = found["all"], found["hpz"]
    assert ("all-gather", "s8") in q and ("all-to-all", "u8") in q  # int8 weights, int4 grads
    gathered = lambda t, axis: sum(  # noqa: E731
        v["by_axis"].get(axis, 0.0) for (k, _), v in t.items() if k == "all-gather"
    )
    for axis in ("data", "fsdp"):  # int8 + one fp32 scale per block vs fp32
        assert 0.2 < gathered(q, axis) / gathered(e, axis) < 0.3
    # hpZ, exact: across nodes (data, D = 2) only the forward hop, (D-1)/D of Ψ/F fp32;
    # inside a node (fsdp, F = 4) the forward and the backward gather, (F-1)/F of Ψ each
    psi = 4 * sum(x.size for x in jax.tree.leaves(params))
    assert gathered(e, "data") == pytest.approx(0.5 * psi / 4)
    assert gathered(e, "fsdp") == pytest.approx(2 * 0.75 * psi)
