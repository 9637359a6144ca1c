"""Parity: does a layout train exactly like one device?

Runs the same config from the same initial state and data on the given mesh and on a
one-device mesh with the same axis names, and compares the per-step losses and gradient
norms, the first step's gradients and (optionally) the final parameters leaf by leaf. Every
strategy in shardlib is tested this way; this module is the one harness the tests use.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import jax
import numpy as np
from jax.sharding import Mesh

from shardlib.core.layout import use_layout
from shardlib.core.mesh import MeshSpec, reference_mesh
from shardlib.dataset.tokens import global_batch, load_tokens
from shardlib.parallel.offload_stream import streams
from shardlib.parallel.pipeline import two_bw
from shardlib.train import fp8, precision
from shardlib.train.config import TrainConfig
from shardlib.train.loop import run
from shardlib.train.setup import TrainSetup, make_setup
from shardlib.train.step import build_train_step, grad_function, make_loss_fn

FP32_TOLERANCE = 1e-5


@dataclass(frozen=True)
class ParityResult:
    losses: list[float]
    reference_losses: list[float]
    max_rel_loss_err: float
    """max over steps of |loss - ref| / |ref|."""
    max_rel_grad_norm_err: float
    """max over steps of |grad_norm - ref| / ref."""
    max_rel_grad_err: float = 0.0
    """max over parameters of ||g - g_ref|| / ||g_ref|| at the first step (when traced)."""
    max_rel_param_err: float = 0.0
    """max over parameters of ||p - p_ref|| / ||p_ref|| after the last step (when traced)."""

    def ok(self, tol: float = FP32_TOLERANCE) -> bool:
        errs = (self.max_rel_loss_err, self.max_rel_grad_norm_err, self.max_rel_grad_err)
        return max(*errs, self.max_rel_param_err) <= tol


def step_records_grads(setup: TrainSetup) -> bool:
    """Whether the train step's first gradients are ``first_grads``'s, so that parity can read
    them from the step it compiles anyway (``build_train_step(record_grads=True)``) instead
    of compiling a gradient program beside it (a third of a parity run's compiling).

    Not where the step's gradients are another thing: 2BW's first step runs an empty
    pipeline, fp16's are scaled (and may overflow), LoRA's leave the base weights out, and
    1-bit, streamed-offload and NVMe steps keep them out of the step's outputs.
    """
    plan = setup.plan
    return not (
        setup.stale_weights
        or precision.uses_loss_scale(setup.cfg.precision)
        or setup.cfg.lora.rank
        or plan.data.onebit_momentum
        or plan.offload.nvme_path
        or (streams(plan) and setup.stacked_layers > 0)
    )


def first_grads(setup: TrainSetup, params: dict | None = None) -> dict:
    """Gradients of the first batch at initialisation (or at ``params``), gathered to host."""
    tokens = global_batch(
        load_tokens(setup.cfg.dataset.path),
        0,
        setup.cfg.dataset.batch,
        setup.cfg.dataset.seq,
        setup.cfg.run.seed,
        setup.batch_sharding,
    )
    if params is None:
        params = setup.natural(setup.init_state()["params"])
    else:
        params = jax.device_put(params, setup.param_shardings)
    grad_fn = grad_function(setup, make_loss_fn(setup))  # the pipeline's own, if any
    fresh_fp8 = setup.fp8_shardings is not None  # FP8: the initial scales, their update dropped

    def grads(p, t):
        with use_layout(setup.mesh, setup.rules):
            meta = setup.init_fp8() if fresh_fp8 else None
            return fp8.split_meta(grad_fn(fp8.with_meta(p, meta), t)[1])[0]

    return jax.device_get(jax.jit(grads)(params, tokens))


@cache
def _random_params(shapes_key: tuple, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        path: np.ones(shape, np.float32)
        if "norm" in path
        else rng.normal(0.0, 0.05, shape).astype(np.float32)
        for path, shape in shapes_key
    }


def random_state(setup: TrainSetup, seed: int = 0) -> dict:
    """A training state drawn with numpy (host arrays): N(0, 0.05) weights, unit norm scales,
    the stacked rows in the model's layer order (``trace`` stores them as the trainer does).

    Compiling a model's own initialiser (threefry per tensor) costs more than a few parity
    steps, so a sweep of many layouts starts every run, and its reference, from this state.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(setup.param_shapes)
    key = tuple((jax.tree_util.keystr(p), tuple(x.shape)) for p, x in flat)
    values = _random_params(key, seed)
    params = jax.tree_util.tree_unflatten(treedef, [values[k] for k, _ in key])
    state = {"params": params, "opt_state": setup.tx.init(params), "step": np.int32(0)}
    if setup.stale_weights:  # 2bw: W(-1) = W(0), and an empty pipeline
        state[two_bw.PREV_PARAMS] = params
        zeros = lambda s: np.zeros(s.shape, s.dtype)  # noqa: E731
        state[two_bw.CARRY] = jax.tree.map(zeros, setup.carry_shapes)
    if precision.uses_loss_scale(setup.cfg.precision):
        state["loss_scale"] = precision.init_loss_scale(setup.cfg.precision)
    if setup.fp8_shardings is not None:
        state[fp8.KEY] = setup.init_fp8()
    return jax.device_get(state)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


def _max_tree_err(got: dict, ref: dict) -> float:
    errs = jax.tree.map(
        lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)), got, ref
    )
    return max(jax.tree.leaves(errs))


@dataclass(frozen=True)
class Trace:
    """What parity compares, from one setup: the per-step records (loss, grad norm and the
    model's metrics), and optionally the first step's gradients and the final parameters."""

    records: list[dict]
    grads: dict | None = None
    params: dict | None = None
    state: dict | None = None
    """The final training state as the run left it (on its devices, in its layout and
    layer order)."""

    @property
    def losses(self) -> list[float]:
        return [r["loss"] for r in self.records]

    @property
    def grad_norms(self) -> list[float]:
        return [r["grad_norm"] for r in self.records]


def trace(
    setup: TrainSetup,
    state: dict | None = None,
    *,
    grads: bool = True,
    params: bool = False,
) -> Trace:
    """Train ``setup`` and record; ``state`` (host or device arrays, e.g. ``random_state``)
    replaces the sharded initialisation.

    Initial values do not depend on the layout (jax's threefry RNG is partitionable), so a
    test sweeping many layouts can initialise once and place that state on each of them.
    ``grads`` records the first step's gradients leaf by leaf, ``params`` the final ones.
    """
    start = None if state is None else jax.device_put(setup.stored(state), setup.state_shardings)
    from_step = grads and step_records_grads(setup) and (state is None or not state["step"])
    step = build_train_step(setup, record_grads=True) if from_step else None
    result = run(setup, state=start, show=False, train_step=step)
    first = None
    if from_step:
        first = setup.natural(result.first_grads)
    elif grads:
        first = first_grads(setup, None if state is None else state["params"])
    final = jax.device_get(setup.natural(result.state["params"])) if params else None
    return Trace(result.records, first, final, result.state)


def compare_traces(got: Trace, ref: Trace) -> ParityResult:
    """Losses and gradient norms always; gradients and parameters where both recorded them."""
    both = got.grads is not None and ref.grads is not None
    params = got.params is not None and ref.params is not None
    return ParityResult(
        losses=got.losses,
        reference_losses=ref.losses,
        max_rel_loss_err=_rel(got.losses, ref.losses),
        max_rel_grad_norm_err=_rel(got.grad_norms, ref.grad_norms),
        max_rel_grad_err=_max_tree_err(got.grads, ref.grads) if both else 0.0,
        max_rel_param_err=_max_tree_err(got.params, ref.params) if params else 0.0,
    )


def compare(
    setup: TrainSetup, reference: TrainSetup | Trace, state: dict | None = None
) -> ParityResult:
    """Train both and compare (same config, different layouts); a Trace is reused as is."""
    ref = reference if isinstance(reference, Trace) else trace(reference, state)
    return compare_traces(trace(setup, state), ref)


@cache
def one_device(cfg: TrainConfig, *, seed: int = 0) -> Trace:
    """The one-device run of ``cfg`` from ``random_state`` with its final parameters (cached:
    a sweep of layouts compares with one reference)."""
    setup = make_setup(cfg, reference_mesh(MeshSpec((("data", 1),)).build(jax.devices()[:1])))
    return trace(setup, random_state(setup, seed), grads=False, params=True)


def check_parity(cfg: TrainConfig, mesh: Mesh, *, seed: int | None = None) -> ParityResult:
    """Parity of ``cfg`` on ``mesh`` against one device, each from its own initialisation
    (so the sharded initialiser is checked too), or with ``seed`` both from that seed's
    ``random_state`` (nothing compiled but the two steps)."""
    # The same plan on size-1 axes lays everything out on the one device.
    reference = make_setup(cfg, reference_mesh(mesh))
    state = None if seed is None else random_state(reference, seed)
    return compare(make_setup(cfg, mesh), reference, state)
