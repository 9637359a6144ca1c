"""One data-parallel gradient reduction per pipeline step (``strategies/pipeline_replicas``).

Compile-only (abstract shapes): ``explain`` reads the optimized HLO of the train step and
counts every collective once per loop trip. A data-axis gradient reduction inside the
pipeline loop would run m + p - 1 (or m + 2(p-1)) times and grow with m; after the loop it
runs once: 2(d-1)/d of the fp32 gradient bytes a device holds (REFERENCE.md, PTD-P).
"""

import math

import jax
import pytest

from shardlib import mesh_spec
from shardlib.analysis import explain
from shardlib.core.layout import use_layout
from shardlib.core.rules import Rules
from shardlib.parallel.pipeline.replicas import replicas
from shardlib.train.config import train_config
from shardlib.train.setup import make_setup

AXES = {"stage": 2, "data": 2, "tensor": 2}


def _report(axes, **overrides):
    cfg = train_config(batch=8, seq=16, **{"model.layers": 4}, **overrides)
    setup = make_setup(cfg, mesh_spec(**axes).build(jax.devices()[: math.prod(axes.values())]))
    report = explain(
        setup.train_step, setup.abstract_state(), setup.abstract_batch(), mesh=setup.mesh
    )
    shapes, shardings = setup.param_shapes, setup.param_shardings
    held = jax.tree.map(lambda s, sh: math.prod(sh.shard_shape(s.shape)) * 4, shapes, shardings)
    return report, sum(jax.tree.leaves(held)), sum(jax.tree.leaves(held["blocks"]))


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule, extra",
    [("gpipe", {}), ("1f1b", {}), ("circular", {"virtual_stages": 2})],
)
def test_data_axis_gradients_are_reduced_once_per_step(schedule, extra):
    """m = p and m = 2p: every data-axis collective runs once per step, and their bytes are
    one ring all-reduce of the held fp32 gradients, whatever m is. (1F1B: the embedding and
    head gradients, one copy per stage, in one ring over data x stage.)"""
    wire = {}
    d, p = AXES["data"], AXES["stage"]
    for m in (2, 4):
        report, held, blocks = _report(
            AXES, pipeline_schedule=schedule, pipeline_microbatches=m, **extra
        )
        data = [op for op in report.collectives if "data" in op.axes]
        assert data and all(op.count == 1 for op in data), [(op.name, op.count) for op in data]
        wire[m] = sum(op.total_wire_bytes for op in data)
        ring = 2 * (d - 1) / d * held
        if schedule == "1f1b":
            ring += (2 * (d * p - 1) / (d * p) - 2 * (d - 1) / d) * (held - blocks)
        assert wire[m] / ring == pytest.approx(1.0, abs=0.05), (m, wire[m], ring)
    assert wire[2] == wire[4]


@pytest.mark.slow
def test_fsdp_weights_gathered_once_per_step_on_request():
    """``gather_weights=step``: the fsdp-axis gathers and gradient reductions leave the loop."""
    axes = {"stage": 2, "fsdp": 2, "tensor": 2}
    for gather, inside in (("microbatch", True), ("step", False)):
        report, _, _ = _report(
            axes,
            pipeline_schedule="1f1b",
            pipeline_microbatches=4,
            pipeline_gather_weights=gather,
        )
        fsdp = [op for op in report.collectives if "fsdp" in op.axes]
        assert any(op.count > 1 for op in fsdp) == inside, [(op.name, op.count) for op in fsdp]


def test_replica_axes_are_the_batch_axes_that_replicate_the_weights():
    mesh = mesh_spec(stage=2, data=2, fsdp=2).build(jax.devices()[:8])
    rules = Rules(
        params={"embed": ("fsdp",), "layers": ("stage",)},
        activations={"batch": ("data", "fsdp")},
    )
    with use_layout(mesh, rules):
        assert replicas().axes == ("data",)
        both = replicas(gather_weights="step")
        assert both.axes == ("data", "fsdp") and both.count == 4
        assert both.inner.params["embed"] == () and both.inner.activations["batch"] == ()
    zero3 = rules.replace(params={"embed": ("data", "fsdp")})
    with use_layout(mesh, zero3):
        assert replicas() is None
    assert replicas() is None  # no layout: one device's program
