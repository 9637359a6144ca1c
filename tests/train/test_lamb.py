"""LAMB with DeepSpeed's switches (``shardlib/train/lamb.py``) against the formulas, by hand.

DeepSpeed's FusedLamb, one step t for a parameter array w with gradient g:
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    d = m / (sqrt(v) + eps)                       (bias_correction: false)
    u = d + wd w                                   (decoupled decay; shardlib masks 1-D arrays)
    r = clip(||w|| / ||u||, min_coeff, max_coeff)  (1 where either norm is 0)
    w = w - lr r u
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from shardlib.train.config import train_config
from shardlib.train.lamb import stacked_dims
from shardlib.train.optim import _optimizer, decay_mask

B1, B2, EPS, WD, LR = 0.9, 0.999, 1e-8, 0.01, 0.5
LO, HI = 0.01, 0.3


def _params():
    rng = np.random.default_rng(0)
    return {
        "big": 100.0 * rng.standard_normal((4, 8)).astype(np.float32),  # ratio > HI: clipped
        "small": 1e-4 * rng.standard_normal((4, 8)).astype(np.float32),  # ratio < LO: clipped
        "mid": 0.3 * rng.standard_normal((16, 16)).astype(np.float32),  # ratio inside
        "zero": np.zeros((3, 5), np.float32),  # ||w|| = 0 on the first step: ratio 1
        "norm": rng.standard_normal((8,)).astype(np.float32),  # 1-D: no decay
    }


def _grads(step: int):
    rng = np.random.default_rng(100 + step)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in _params().items()}


def _by_hand(steps: int, *, bias_correction: bool, lo: float, hi: float):
    w = {k: v.astype(np.float64) for k, v in _params().items()}
    m = {k: np.zeros_like(v) for k, v in w.items()}
    v2 = {k: np.zeros_like(v) for k, v in w.items()}
    ratios = []
    for t in range(1, steps + 1):
        g = _grads(t - 1)
        step_ratios = {}
        for k in w:
            m[k] = B1 * m[k] + (1 - B1) * g[k]
            v2[k] = B2 * v2[k] + (1 - B2) * g[k] ** 2
            mh, vh = m[k], v2[k]
            if bias_correction:
                mh, vh = mh / (1 - B1**t), vh / (1 - B2**t)
            u = mh / (np.sqrt(vh) + EPS) + (WD * w[k] if w[k].ndim >= 2 else 0.0)
            wn, un = np.linalg.norm(w[k]), np.linalg.norm(u)
            r = 1.0 if wn == 0 or un == 0 else float(np.clip(wn / un, lo, hi))
            step_ratios[k] = r
            w[k] = w[k] - LR * r * u
        ratios.append(step_ratios)
    return w, ratios


def _run(tx, steps: int):
    params = jax.tree.map(jnp.asarray, _params())
    state = tx.init(params)
    for t in range(steps):
        updates, state = tx.update(jax.tree.map(jnp.asarray, _grads(t)), state, params)
        params = optax.apply_updates(params, updates)
    return jax.device_get(params)


def _lamb(**settings):
    cfg = train_config(optimizer="lamb", b1=B1, b2=B2, eps=EPS, weight_decay=WD, **settings)
    return _optimizer(cfg.optimizer, optax.constant_schedule(LR))


def test_clipped_trust_ratio_without_bias_correction_matches_the_formula():
    tx = _lamb(bias_correction=False, trust_ratio_min=LO, trust_ratio_max=HI)
    want, ratios = _by_hand(3, bias_correction=False, lo=LO, hi=HI)
    # every branch of the clip is exercised, on every step
    assert all(r["big"] == HI and r["small"] == LO and LO < r["mid"] < HI for r in ratios)
    assert ratios[0]["zero"] == 1.0  # moved by the first step
    got = _run(tx, 3)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-7, err_msg=k)


def test_bounds_change_the_update_and_unbounded_is_optax_lamb():
    bounded = _run(_lamb(trust_ratio_min=LO, trust_ratio_max=HI), 2)
    plain = _run(_lamb(), 2)
    want, _ = _by_hand(2, bias_correction=True, lo=0.0, hi=np.inf)
    for k in want:
        # unbounded, "big" moves by ~50x its update: float32 rounding of values ~100
        np.testing.assert_allclose(plain[k], want[k], rtol=2e-5, atol=2e-4, err_msg=k)
    reference = optax.lamb(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD, mask=decay_mask)
    for k, v in _run(reference, 2).items():
        np.testing.assert_array_equal(plain[k], v, err_msg=k)  # the same chain, exactly
    assert not np.allclose(bounded["big"], plain["big"])  # clipped at HI: a smaller step


def test_trust_ratio_bounds_are_checked():
    import pytest

    from shardlib.core.errors import ShardingError

    with pytest.raises(ShardingError, match="optimizer=adamw.*Fix: optimizer=lamb"):
        train_config(trust_ratio_max=0.3)
    with pytest.raises(ShardingError, match="optimizer=sgd keeps none"):
        train_config(optimizer="sgd", bias_correction=False)
    with pytest.raises(ShardingError, match="0 <= min <= max"):
        train_config(optimizer="lamb", trust_ratio_min=0.5, trust_ratio_max=0.3)


def test_adamw_without_bias_correction_matches_the_formula():
    """DeepSpeed's BERT examples' Adam(W): the same direction, decay, no trust ratio (the
    hand computation with the ratio pinned to 1)."""
    cfg = train_config(b1=B1, b2=B2, eps=EPS, weight_decay=WD, bias_correction=False)
    got = _run(_optimizer(cfg.optimizer, optax.constant_schedule(LR)), 3)
    want, _ = _by_hand(3, bias_correction=False, lo=1.0, hi=1.0)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-6, err_msg=k)


def _stacked(name: str):
    """Three layers of ``name`` stacked ``[layers, ...]``, the way blocks are stored."""
    rng = np.random.default_rng(7)
    scales = np.array([10.0, 1.0, 1e-3], np.float32)[:, None, None]  # ratios far apart
    return {name: scales * rng.standard_normal((3, 4, 8)).astype(np.float32)}


def test_trust_ratio_is_per_layer_of_a_stacked_array():
    """A stacked ``[layers, ...]`` weight gets one trust ratio per layer (the paper's per
    tensor of an unstacked model), LAMB and LARS alike: the same updates as three separate
    arrays, and not what one ratio for the whole stack (optax's per-array) gives."""
    names = {"w": ("layers", "embed", "mlp")}
    leads = stacked_dims(names)
    stacked = jax.tree.map(jnp.asarray, _stacked("w"))
    grads = jax.tree.map(lambda x: 0.1 * jnp.ones_like(x) + 0.01 * x, stacked)
    split = lambda t: {f"w{i}": t["w"][i] for i in range(3)}  # noqa: E731
    for name in ("lamb", "lars"):
        cfg = train_config(optimizer=name, b1=B1, b2=B2, eps=EPS, weight_decay=WD).optimizer
        per_layer, per_array = _optimizer(cfg, LR, leads), _optimizer(cfg, LR)
        got, _ = per_layer.update(grads, per_layer.init(stacked), stacked)
        whole, _ = per_array.update(grads, per_array.init(stacked), stacked)
        ref, _ = per_array.update(split(grads), per_array.init(split(stacked)), split(stacked))
        np.testing.assert_allclose(got["w"], np.stack([ref[f"w{i}"] for i in range(3)]),
                                   rtol=1e-6)  # fmt: skip
        assert not np.allclose(got["w"], whole["w"], rtol=1e-2)
