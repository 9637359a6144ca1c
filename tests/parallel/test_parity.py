"""Parity: every layout trains exactly like one device (fp32, relative error <= 1e-5).

The one-device reference runs once per config and is shared by all meshes.
"""

import jax
import numpy as np
import pytest

from shardlib import mesh_spec
from shardlib.tools.parity import FP32_TOLERANCE, compare, reference_mesh, trace
from shardlib.train.config import train_config
from shardlib.train.setup import make_setup

CFG = train_config(steps=5, batch=16, seq=32)
CFG_ACCUM = train_config(steps=5, batch=16, seq=32, data_microbatches=2)
CFG_FULL_REMAT = train_config(steps=5, batch=16, seq=32, remat="full")


@pytest.fixture(scope="module")
def reference():
    cache = {}

    def get(cfg):
        """Axis names do not matter on one device: one reference per config."""
        if cfg not in cache:
            mesh = reference_mesh(mesh_spec(data=1).build(jax.devices()[:1]))
            cache[cfg] = trace(make_setup(cfg, mesh))
        return cache[cfg]

    return get


MESHES = {
    "dp8": {"data": 8},
    "fsdp8": {"fsdp": 8},
    "tp8": {"tensor": 8},  # llama-tiny: 16 heads, 8 kv-heads -> 8 is the largest TP degree
    "3d": {"data": 2, "fsdp": 2, "tensor": 2},
    "fsdp2x4tp": {"fsdp": 2, "tensor": 4},
}


# the 2 x 2 x 2 case stays in the fast subset (pytest -m "not slow") as its parity smoke test
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=() if n == "3d" else pytest.mark.slow) for n in MESHES]
)
def test_parity_fp32(name, reference):
    axes = MESHES[name]
    setup = make_setup(CFG, mesh_spec(**axes).build())
    result = compare(setup, reference(CFG))
    assert result.max_rel_loss_err <= FP32_TOLERANCE, result
    assert result.max_rel_grad_err <= FP32_TOLERANCE, result
    assert result.ok(), result


@pytest.mark.slow
def test_parity_with_partitioned_saved_inputs(reference):
    """Full remat under tensor parallelism keeps each block's input split over ``tensor``
    (``parallel.remat.partition_saved_inputs``) and trains like one device without remat
    (remat changes no arithmetic: test_remat.py)."""
    setup = make_setup(CFG_FULL_REMAT, mesh_spec(**MESHES["3d"]).build())
    result = compare(setup, reference(CFG))
    assert result.ok(), result


@pytest.mark.slow
def test_parity_with_gradient_accumulation(reference):
    axes = MESHES["3d"]
    result = compare(make_setup(CFG_ACCUM, mesh_spec(**axes).build()), reference(CFG_ACCUM))
    assert result.ok(), result


@pytest.mark.slow
def test_accumulation_equals_the_full_batch(reference):
    """Two micro-batches of 8 give the same loss as one batch of 16 (mean of equal means)."""
    one, accum = reference(CFG), reference(CFG_ACCUM)
    assert np.allclose(one.losses, accum.losses, rtol=FP32_TOLERANCE, atol=0)
