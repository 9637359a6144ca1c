"""Parity: every layout trains exactly like one device (fp32, relative error <= 1e-5).

The one-device reference runs once per config and is shared by all meshes.
"""

import math

import jax
import numpy as np
import pytest

from shardlib import mesh_spec
from shardlib.tools.parity import (
    FP32_TOLERANCE,
    compare,
    first_grads,
    random_state,
    reference_mesh,
    step_records_grads,
    trace,
)
from shardlib.train.config import override, train_config
from shardlib.train.setup import make_setup

CFG = train_config(steps=5, batch=16, seq=32)
CFG_ACCUM = train_config(steps=5, batch=16, seq=32, data_microbatches=2)
CFG_FULL_REMAT = train_config(steps=5, batch=16, seq=32, remat="full")


def _one_device(cfg):
    return make_setup(cfg, reference_mesh(mesh_spec(data=1).build(jax.devices()[:1])))


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(cfg, own_init: bool = False):
        """Axis names do not matter on one device: one reference per config, from its own
        initialisation or from ``random_state`` (no initialiser compiled on either side)."""
        if (cfg, own_init) not in cache:
            setup = _one_device(cfg)
            cache[cfg, own_init] = trace(setup, None if own_init else random_state(setup))
        return cache[cfg, own_init]

    return get


MESHES = {
    "dp8": {"data": 8},
    "fsdp8": {"fsdp": 8},
    "tp8": {"tensor": 8},  # llama-tiny: 16 heads, 8 kv-heads -> 8 is the largest TP degree
    "3d": {"data": 2, "fsdp": 2, "tensor": 2},
    "fsdp2x4tp": {"fsdp": 2, "tensor": 4},
}


# the 2 x 2 x 2 case stays in the fast subset (pytest -m "not slow") as its parity smoke test,
# and starts from each side's own sharded initialisation (the others from one random state)
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n == "3d" else pytest.mark.slow) for n in MESHES]
)
def test_parity_fp32(name, reference):
    axes = MESHES[name]
    setup = make_setup(CFG, mesh_spec(**axes).build())
    own_init = name == "3d"
    state = None if own_init else random_state(_one_device(CFG))
    result = compare(setup, reference(CFG, own_init), state)
    assert result.max_rel_loss_err <= FP32_TOLERANCE, result
    assert result.max_rel_grad_err <= FP32_TOLERANCE, result
    assert result.ok(), result


def test_sharded_initialisation_gives_the_one_device_values():
    """Layouts initialise the same values as one device (jax's threefry is partitionable),
    so the other parity tests may start both sides from one random state."""
    want = jax.device_get(_one_device(CFG).init_state())
    for name in ("fsdp8", "fsdp2x4tp"):  # (3d's parity test starts from its own, too)
        got = jax.device_get(make_setup(CFG, mesh_spec(**MESHES[name]).build()).init_state())
        errs = jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), got, want)
        assert max(jax.tree.leaves(errs)) == 0.0, (name, errs)


@pytest.mark.slow
def test_parity_with_partitioned_saved_inputs(reference):
    """Full remat under tensor parallelism keeps each block's input split over ``tensor``
    (``parallel.remat.partition_saved_inputs``) and trains like one device without remat
    (remat changes no arithmetic: test_remat.py)."""
    setup = make_setup(CFG_FULL_REMAT, mesh_spec(**MESHES["3d"]).build())
    result = compare(setup, reference(CFG), random_state(setup))
    assert result.ok(), result


@pytest.mark.slow
def test_parity_with_gradient_accumulation(reference):
    axes = MESHES["3d"]
    setup = make_setup(CFG_ACCUM, mesh_spec(**axes).build())
    result = compare(setup, reference(CFG_ACCUM), random_state(setup))
    assert result.ok(), result


@pytest.mark.slow
def test_accumulation_equals_the_full_batch(reference):
    """Two micro-batches of 8 give the same loss as one batch of 16 (mean of equal means)."""
    one, accum = reference(CFG), reference(CFG_ACCUM)
    assert np.allclose(one.losses, accum.losses, rtol=FP32_TOLERANCE, atol=0)


@pytest.mark.parametrize(
    "axes,overrides",
    [
        pytest.param({"data": 2, "fsdp": 2, "tensor": 2}, {}, id="3d"),
        # a circular pipeline stores its rows in stage order: the recorded ones are put back
        pytest.param(
            {"stage": 2},
            {"pipeline_schedule": "circular", "virtual_stages": 2, "pipeline_microbatches": 2},
            id="circular",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_the_steps_recorded_gradients_are_the_gradient_programs(axes, overrides):
    """Parity reads the first step's gradients from the train step (``record_grads``): they
    are the separately compiled gradient program's (``first_grads``), leaf by leaf, in the
    model's layer order, and a wrong leaf would show."""
    cfg = override(train_config(steps=1, batch=8, seq=16, **{"model.layers": 4}), overrides)
    mesh = mesh_spec(**axes).build(jax.devices()[: math.prod(axes.values())])
    setup = make_setup(cfg, mesh)
    state = random_state(setup)
    assert not setup.layer_order.natural or "stage" not in axes
    assert step_records_grads(setup)
    recorded = trace(setup, state).grads
    separate = first_grads(setup, state["params"])
    assert jax.tree.structure(recorded) == jax.tree.structure(separate)
    errs = jax.tree.map(
        lambda a, b: float(np.linalg.norm(a - b) / np.linalg.norm(b)), recorded, separate
    )
    assert max(jax.tree.leaves(errs)) <= FP32_TOLERANCE, errs
    rows = recorded["blocks"]["mlp"]["w_up"]  # [layers, embed, mlp]: distinct per layer
    assert not np.allclose(rows[0], rows[-1])
    swapped = np.linalg.norm(rows[::-1] - separate["blocks"]["mlp"]["w_up"])
    assert swapped > 10 * FP32_TOLERANCE * np.linalg.norm(rows)  # the order is checked
