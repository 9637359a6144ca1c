"""Parity of whole training runs from one shared initial state (helpers for ZeRO/optimizer tests).

Every run starts from the same parameters, drawn once with numpy, with its optimizer state made
by ``tx.init`` and placed into the setup's state layout: a case then costs one compile of its
train step and nothing else. (Sharded initialisation itself is tested by the core's parity
tests.) A run matches when losses, gradient norms and the final parameters agree with the
one-device run to ``FP32_TOLERANCE`` relative.
"""

from functools import cache

import jax
import jax.numpy as jnp
import numpy as np

from shardlib import mesh_spec
from shardlib.parity import FP32_TOLERANCE, reference_mesh
from shardlib.train import precision
from shardlib.train.loop import RunResult, run
from shardlib.train.setup import TrainSetup, make_setup


@cache
def _initial_params(model_cfg, shapes_key) -> dict:
    """Normal(0, 0.05) weights and unit norm scales, from numpy: compiling the model's own
    initialiser (threefry per tensor) costs more than all the parity steps together."""
    rng = np.random.default_rng(0)
    return {
        path: np.ones(shape, np.float32)
        if "norm" in path
        else rng.normal(0.0, 0.05, shape).astype(np.float32)
        for path, shape in shapes_key
    }


def initial_params(setup: TrainSetup) -> dict:
    flat, treedef = jax.tree_util.tree_flatten_with_path(setup.param_shapes)
    key = tuple((jax.tree_util.keystr(p), tuple(x.shape)) for p, x in flat)
    values = _initial_params(setup.model_cfg, key)
    return jax.tree_util.tree_unflatten(treedef, [values[k] for k, _ in key])


def initial_state(setup: TrainSetup) -> dict:
    params = initial_params(setup)
    opt_state = jax.jit(setup.tx.init)(params)
    state = {"params": params, "opt_state": opt_state, "step": jnp.zeros((), jnp.int32)}
    if precision.uses_loss_scale(setup.cfg.precision):
        state["loss_scale"] = precision.init_loss_scale(setup.cfg.precision)
    return jax.device_put(state, setup.state_shardings)


def train(cfg, **axes) -> tuple[TrainSetup, RunResult]:
    mesh = mesh_spec(**axes).build() if axes else None
    if mesh is None:
        mesh = reference_mesh(mesh_spec(data=1).build(jax.devices()[:1]))
    setup = make_setup(cfg, mesh)
    return setup, run(setup, state=initial_state(setup), show=False)


@cache
def reference(cfg) -> tuple[list, list, dict]:
    """Losses, gradient norms and final parameters of ``cfg`` on one device (cached)."""
    _, result = train(cfg)
    grad_norms = [r["grad_norm"] for r in result.records]
    return result.losses, grad_norms, jax.device_get(result.state["params"])


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


def max_param_err(params, ref_params) -> float:
    """max over parameters of ||p - p_ref|| / ||p_ref||."""
    errs = jax.tree.map(
        lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)),
        jax.device_get(params),
        ref_params,
    )
    return max(jax.tree.leaves(errs))


def assert_parity(result: RunResult, ref, tol: float = FP32_TOLERANCE) -> None:
    losses, grad_norms, params = ref
    assert rel(result.losses, losses) <= tol, (result.losses, losses)
    assert rel([r["grad_norm"] for r in result.records], grad_norms) <= tol
    assert max_param_err(result.state["params"], params) <= tol
