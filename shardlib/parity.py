"""Parity: does a layout train exactly like one device?

Runs the same config from the same seed and data on the given mesh and on a one-device
mesh with the same axis names, and compares the per-step losses and gradient norms, and the
first step's gradients leaf by leaf. Every strategy in shardlib is tested this way.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np
from jax.sharding import Mesh

from shardlib.layout import use_layout
from shardlib.mesh import MeshSpec
from shardlib.train.config import TrainConfig
from shardlib.train.data import global_batch, load_tokens
from shardlib.train.loop import run
from shardlib.train.setup import TrainSetup, make_setup
from shardlib.train.step import grad_function, make_loss_fn

FP32_TOLERANCE = 1e-5


@dataclass(frozen=True)
class ParityResult:
    losses: list[float]
    reference_losses: list[float]
    max_rel_loss_err: float
    """max over steps of |loss - ref| / |ref|."""
    max_rel_grad_norm_err: float
    """max over steps of |grad_norm - ref| / ref."""
    max_rel_grad_err: float
    """max over parameters of ||g - g_ref|| / ||g_ref|| at the first step."""

    def ok(self, tol: float = FP32_TOLERANCE) -> bool:
        return max(self.max_rel_loss_err, self.max_rel_grad_norm_err, self.max_rel_grad_err) <= tol


def reference_mesh(mesh: Mesh) -> Mesh:
    """One device, the same axis names, every axis of size 1."""
    return MeshSpec(tuple((n, 1) for n in mesh.axis_names)).build(jax.devices()[:1])


def first_grads(setup: TrainSetup, params: dict | None = None) -> dict:
    """Gradients of the first batch at initialisation (or at ``params``), gathered to host."""
    tokens = global_batch(
        load_tokens(setup.cfg.data.path),
        0,
        setup.cfg.data.batch,
        setup.cfg.data.seq,
        setup.cfg.run.seed,
        setup.batch_sharding,
    )
    if params is None:
        params = setup.init_state()["params"]
    else:
        params = jax.device_put(params, setup.param_shardings)
    grad_fn = grad_function(setup, make_loss_fn(setup))  # the pipeline's own, if any

    def grads(p, t):
        with use_layout(setup.mesh, setup.rules):
            return grad_fn(p, t)[1]

    return jax.device_get(jax.jit(grads)(params, tokens))


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


@dataclass(frozen=True)
class Trace:
    """What parity compares, from one setup: per-step losses and grad norms, first grads."""

    losses: list[float]
    grad_norms: list[float]
    grads: dict


def trace(setup: TrainSetup, state: dict | None = None) -> Trace:
    """Train and record; ``state`` (host arrays) skips the initialisation compile.

    Initial values do not depend on the layout (jax's threefry RNG is partitionable), so a
    test sweeping many layouts can initialise once and place that state on each of them.
    """
    if state is None:
        return Trace(*_run(setup, None), first_grads(setup))
    return Trace(*_run(setup, state), first_grads(setup, state["params"]))


def _run(setup: TrainSetup, state: dict | None) -> tuple[list[float], list[float]]:
    if state is not None:
        state = jax.device_put(state, setup.state_shardings)
    result = run(setup, state=state, show=False)
    return result.losses, [r["grad_norm"] for r in result.records]


def compare(
    setup: TrainSetup, reference: TrainSetup | Trace, state: dict | None = None
) -> ParityResult:
    """Train both and compare (same config, different layouts); a Trace is reused as is."""
    got = trace(setup, state)
    ref = reference if isinstance(reference, Trace) else trace(reference)
    grad_errs = jax.tree.map(
        lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)),
        got.grads,
        ref.grads,
    )
    return ParityResult(
        losses=got.losses,
        reference_losses=ref.losses,
        max_rel_loss_err=_rel(got.losses, ref.losses),
        max_rel_grad_norm_err=_rel(got.grad_norms, ref.grad_norms),
        max_rel_grad_err=max(jax.tree.leaves(grad_errs)),
    )


def check_parity(cfg: TrainConfig, mesh: Mesh) -> ParityResult:
    """Parity of ``cfg`` on ``mesh`` against one device."""
    # The same plan on size-1 axes lays everything out on the one device.
    return compare(make_setup(cfg, mesh), make_setup(cfg, reference_mesh(mesh)))
