"""1-bit LAMB (``shardlib/train/onebit_lamb.py``): warm-up parity with LAMB, the compressed
phase's wire bytes against the 1-bit formula, the frozen coefficients against a hand
computation, and the refusals.

The hand computation follows DeepSpeed's OnebitLamb (bias_correction false), on a tiny tree
over 2 devices, warm-up for 2 steps then one compressed step:
    warm-up:  g = mean_d g_d;  m, v as LAMB;  u = m / (sqrt(v) + eps) + wd w
              r = ||w|| / ||u||;  c = cb c + (1 - cb) r;  w -= lr r u
    freeze:   v_fresh = v;  s_p = mean_q rms(m_q) / rms(m_p)
    compress: x_d = (b1 m + (1 - b1) g_d) s  ->  1-bit average (signs x mean|.| per chunk,
              on the worker then on the server)  ->  m' = avg / s
              g~ = (m' - b1 m) / (1 - b1);  v_fresh = b2 v_fresh + (1 - b2) g~^2
              u' = m' / (sqrt(v) + eps);  u = u' + wd w
              f = max((sqrt(v) + eps) / (sqrt(v_fresh) + eps));  q = min(1, ||u'|| / ||u||)
              f = clip(clip(q f + 1 - q, fmin, fmax), 1 - thr, 1 + thr);  update = c f u
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import shardlib
from benchmarks.comm_compression import collective_bytes
from shardlib.core.errors import ShardingError
from shardlib.tools.parity import random_state, trace
from shardlib.train.config import train_config
from shardlib.train.lamb import per_array, stacked_dims
from shardlib.train.onebit import padded_size
from shardlib.train.onebit_lamb import Factors, scale_by_onebit_lamb
from shardlib.train.setup import make_setup

SMALL = {"model.layers": 1, "model.embed": 32, "model.heads": 4, "model.kv_heads": 2,
         "model.head_dim": 8, "model.mlp": 64}  # fmt: skip
BASE = dict(batch=16, seq=16, steps=3, schedule="constant", lr=1e-2, weight_decay=0.1,
            clip_norm=0.0, trust_ratio_min=0.01, trust_ratio_max=10.0, **SMALL)  # fmt: skip
B1, B2, EPS, WD, LR, CB = 0.9, 0.999, 1e-8, 0.1, 0.05, 0.9
F = Factors(coeff_beta=CB, factor_max=4.0, factor_min=0.5, factor_threshold=0.01)  # one clips


def test_warmup_is_lamb_then_the_momentum_crosses_in_one_bit():
    """Warm-up (2 of 3 steps) equals ``optimizer=lamb`` (fp32, rel err <= 1e-5) on data=8;
    the compressed phase moves only packed signs and scales: all-to-all + all-gather of
    2(N-1)/N · (P/8 + 4N) bytes per device, within 5% of 1-bit Adam's 2(N-1)/N · Ψ/8."""
    mesh = shardlib.mesh_spec(data=8).build(jax.devices()[:8])
    lamb = make_setup(train_config(optimizer="lamb", **BASE), mesh)
    ref = trace(lamb, random_state(lamb), grads=False)
    setup = make_setup(train_config(optimizer="onebit_lamb", freeze_step=2, **BASE), mesh)
    got = trace(setup, random_state(setup), grads=False)
    pairs = zip(got.losses, ref.losses, strict=True)  # step 3's loss is before its update
    assert max(abs(a - b) / abs(b) for a, b in pairs) <= 1e-5
    pairs = zip(jax.tree.leaves(got.state["params"]), jax.tree.leaves(ref.state["params"]),
                strict=True)  # fmt: skip
    assert any(not np.allclose(a, b) for a, b in pairs)  # the compressed step moved them
    compiled = setup.train_step.lower(setup.abstract_state(), setup.abstract_batch()).compile()
    found = collective_bytes(compiled.as_text(), mesh)
    n, psi = 8, sum(x.size for x in jax.tree.leaves(setup.param_shapes))
    p = padded_size(setup.param_shapes, n)
    assert found[("all-to-all", "u8")]["buffer_bytes"] == p // 8
    assert found[("all-gather", "u8")]["buffer_bytes"] == p // 8
    wire = sum(v["wire_bytes"] for (k, _), v in found.items() if k in ("all-to-all", "all-gather"))
    ring = 2 * (n - 1) / n
    assert wire == pytest.approx(ring * (p / 8 + 4 * n))
    assert abs(wire / (ring * psi / 8) - 1) <= 0.05


def test_all_warmup_run_equals_lamb_parameters():
    """A run that never leaves warm-up holds only the fp32 path: LAMB's parameters."""
    mesh = shardlib.mesh_spec(data=8).build(jax.devices()[:8])
    base = dict(BASE, steps=2)
    lamb = make_setup(train_config(optimizer="lamb", **base), mesh)
    ref = trace(lamb, random_state(lamb), grads=False, params=True)
    setup = make_setup(train_config(optimizer="onebit_lamb", freeze_step=2, **base), mesh)
    got = trace(setup, random_state(setup), grads=False, params=True)
    for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(ref.params), strict=True):
        assert np.max(np.abs(a - b)) <= 1e-5 * np.max(np.abs(b))


def _tree():
    rng = np.random.default_rng(0)
    return {"a": rng.standard_normal((8,)).astype(np.float32),  # 1-D: no decay
            "b": 0.5 * rng.standard_normal((2, 4)).astype(np.float32)}  # fmt: skip


def _grads(step: int):  # [2 devices, ...] each
    rng = np.random.default_rng(10 + step)
    return {k: rng.standard_normal((2, *v.shape)).astype(np.float32) for k, v in _tree().items()}


def _mask(params):
    return {"a": False, "b": True}


def _onebit_mean(xs):
    """[D, C, K] -> [C, K]: worker codes, their mean per server chunk, the server code."""
    code = lambda x: np.mean(np.abs(x), -1, keepdims=True) * np.where(x >= 0, 1.0, -1.0)  # noqa: E731
    return code(np.mean(code(xs), axis=0))


def _by_hand():
    w = {k: v.astype(np.float64) for k, v in _tree().items()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    v2 = {k: np.zeros_like(v) for k, v in w.items()}
    c = {k: 0.0 for k in w}
    decay = lambda k: WD * w[k] if _mask(w)[k] else 0.0  # noqa: E731
    for t in range(2):
        g = _grads(t)
        for k in w:
            gbar = g[k].mean(0)
            m[k] = B1 * m[k] + (1 - B1) * gbar
            v2[k] = B2 * v2[k] + (1 - B2) * gbar**2
            u = m[k] / (np.sqrt(v2[k]) + EPS) + decay(k)
            r = np.linalg.norm(w[k]) / np.linalg.norm(u)
            c[k] = CB * c[k] + (1 - CB) * r
            w[k] = w[k] - LR * r * u
    fresh = dict(v2)
    rms = {k: np.linalg.norm(m[k]) / np.sqrt(m[k].size) for k in w}
    s = {k: np.mean(list(rms.values())) / rms[k] for k in w}
    g = _grads(2)
    xs = np.concatenate([((B1 * m[k] + (1 - B1) * g[k]) * s[k]).reshape(2, -1) for k in w], 1)
    avg = _onebit_mean(xs.reshape(2, 2, 8)).reshape(-1)  # 16 elements: 2 chunks of 8
    out, factors = {}, {}
    for k, sl in (("a", slice(0, 8)), ("b", slice(8, 16))):
        mk = avg[sl].reshape(w[k].shape) / s[k]
        recon = (mk - B1 * m[k]) / (1 - B1)
        fresh[k] = B2 * fresh[k] + (1 - B2) * recon**2
        denom = np.sqrt(v2[k]) + EPS
        prelim = mk / denom
        u = prelim + decay(k)
        f = np.max(denom / (np.sqrt(fresh[k]) + EPS))
        q = min(1.0, np.linalg.norm(prelim) / np.linalg.norm(u))
        f = np.clip(q * f + 1 - q, F.factor_min, F.factor_max)
        f = np.clip(f, 1 - F.factor_threshold, 1 + F.factor_threshold)  # last factor: 1
        factors[k], out[k] = f, c[k] * f * u
    return c, factors, out


def test_frozen_coefficients_and_factor_match_a_hand_computation():
    mesh = shardlib.mesh_spec(data=2).build(jax.devices()[:2])
    tx = scale_by_onebit_lamb(
        b1=B1, b2=B2, eps=EPS, weight_decay=WD, mask=_mask, freeze_step=2, n=2, steps=3,
        bias_correction=False, factors=F,
    )  # fmt: skip
    params = jax.tree.map(jnp.asarray, _tree())
    state = tx.init(params)
    specs = jax.tree.map(lambda _: P(), state)._replace(worker_error=P("data"),
                                                        server_error=P("data"))  # fmt: skip
    grad_specs = jax.tree.map(lambda _: P("data"), params)

    def one(grads, state, params):
        grads = jax.tree.map(lambda g: g[0], grads)
        return tx.update(grads, state, params)

    step = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=(grad_specs, specs, P()),
                                 out_specs=(P(), specs), check_vma=False))  # fmt: skip
    for t in range(3):
        updates, state = step(_grads(t), state, params)
        if t < 2:
            params = jax.tree.map(lambda w, u: w - LR * u, params, updates)
    coeff, factors, out = _by_hand()
    for k in ("a", "b"):
        np.testing.assert_allclose(state.coeff[k], coeff[k], rtol=1e-5)
        np.testing.assert_allclose(state.last_factor[k], factors[k], rtol=1e-5)
        np.testing.assert_allclose(updates[k], out[k], rtol=1e-4, atol=1e-7)
    assert sorted(factors.values())[0] == 1 - F.factor_threshold  # the threshold bit
    assert 1 - F.factor_threshold < sorted(factors.values())[1] < 1  # and one that did not


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(freeze_step=0), "freeze_step=0"),
        (dict(coeff_beta=1.0), "coeff_beta=1.0"),
        (dict(factor_min=2.0), "factor_min=2.0"),
        (dict(factor_max=0.8), "factor_max=0.8"),
        (dict(factor_threshold=1.0), "factor_threshold=1.0"),
    ],
)
def test_bad_settings_are_refused(settings, match):
    with pytest.raises(ShardingError, match=f"onebit_lamb.*{match}.*Fix"):
        train_config(optimizer="onebit_lamb", **settings)


def test_onebit_lamb_refuses_zero_like_onebit_adam():
    mesh = shardlib.mesh_spec(data=8).build(jax.devices()[:8])
    with pytest.raises(ShardingError, match="onebit_lamb.*zero=1.*Fix"):
        make_setup(train_config(optimizer="onebit_lamb", zero=1, **BASE), mesh)


def test_coefficients_are_per_layer_of_a_stacked_array():
    """``b`` stacked ``[2 layers, 4]`` with ``leads`` gives the same coefficients, factors and
    updates as its two layers as separate arrays (the same flat vector crosses in 1 bit)."""
    mesh = shardlib.mesh_spec(data=2).build(jax.devices()[:2])
    split = lambda t: {"a": t["a"], "b0": t["b"][..., 0, :], "b1": t["b"][..., 1, :]}  # noqa: E731

    def run(tree_of, leads):
        tx = scale_by_onebit_lamb(
            b1=B1, b2=B2, eps=EPS, weight_decay=WD, mask=lambda p: jax.tree.map(lambda _: True, p),
            freeze_step=2, n=2, steps=3, bias_correction=False, factors=F, leads=leads,
        )  # fmt: skip
        params = jax.tree.map(jnp.asarray, tree_of(_tree()))
        state = tx.init(params)
        specs = jax.tree.map(lambda _: P(), state)._replace(worker_error=P("data"),
                                                            server_error=P("data"))  # fmt: skip

        def one(grads, state, params):
            return tx.update(jax.tree.map(lambda g: g[0], grads), state, params)

        step = jax.jit(jax.shard_map(
            one, mesh=mesh, in_specs=(jax.tree.map(lambda _: P("data"), params), specs, P()),
            out_specs=(P(), specs), check_vma=False))  # fmt: skip
        for t in range(3):
            updates, state = step(tree_of(_grads(t)), state, params)
            params = jax.tree.map(lambda w, u: w - LR * u, params, updates)
        return updates, state

    got, got_state = run(lambda t: t, stacked_dims({"a": (None,), "b": ("layers", None)}))
    ref, ref_state = run(split, per_array)
    assert got_state.coeff["b"].shape == (2,)
    for field in ("coeff", "last_factor", "momentum_scale"):
        mine, theirs = getattr(got_state, field), getattr(ref_state, field)
        np.testing.assert_allclose(mine["b"], [theirs["b0"], theirs["b1"]], rtol=1e-5)
    np.testing.assert_allclose(got["b"], np.stack([ref["b0"], ref["b1"]]), rtol=1e-4, atol=1e-7)
