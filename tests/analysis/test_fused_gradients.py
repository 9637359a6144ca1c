"""``explain`` on train steps whose gradient reductions XLA's all-reduce combiner fused.

Data parallel: the gradients of a layer (or of the embedding, head and final norm) travel in
one tuple all-reduce, whose metadata names one of many lines; the report must call it a
fused gradient sync and say how many tensors it carries. FSDP: the combiner also fuses the
loss scalar and small replicated values into the gradient reduction; the GPU-form recount
must still count the sliced gradients as reduce-scatters, so that GPU-form bytes are
ZeRO-3's all-gather + reduce-scatter and not 1.5x that. Compile only (abstract shapes).
"""

import math

import jax
import pytest

from shardlib import mesh_spec
from shardlib.analysis import explain
from shardlib.analysis.report import ring_wire_bytes
from shardlib.train.config import train_config
from shardlib.train.setup import make_setup

CFG = train_config(model="llama-tiny", batch=16, seq=32)
N = 8  # devices


def _report(**axes):
    setup = make_setup(CFG, mesh_spec(**axes).build(jax.devices()[:N]))
    state = setup.abstract_state()
    batch = setup.abstract_batch()
    return setup, explain(setup.train_step, state, batch, mesh=setup.mesh, params=state["params"])


def _sizes(setup) -> tuple[int, int]:
    """Elements of the stacked blocks' parameters and of the rest (embedding, head, norm)."""
    params = setup.inventory.params
    blocks = sum(math.prod(p.shape) for p in params if p.path.startswith("blocks."))
    return blocks, setup.inventory.param_count - blocks


def test_a_fused_data_parallel_gradient_sync_is_labelled_with_its_tensor_count():
    setup, report = _report(data=N)
    fused = [op for op in report.collectives if op.fused_tensors]
    assert fused, [(op.kind, op.moves) for op in report.collectives]
    for op in fused:
        assert op.kind == "all-reduce" and op.axes == ("data",)
        assert op.moves == f"fused gradient sync ({op.fused_tensors} tensors)"
    assert not any("Attention.__call__" in op.moves for op in report.collectives)
    # between them the fused syncs carry every gradient once per step (XLA may have merged
    # two gradients into one array: the tensor count is what the HLO carries, not a leaf
    # count), plus the loss scalar riding along
    blocks, rest = _sizes(setup)
    wire = sum(op.total_wire_bytes for op in fused)
    expected = ring_wire_bytes("all-reduce", 4 * (blocks + rest), N)
    assert wire == pytest.approx(expected, rel=0.001)


def test_fsdp_gpu_form_is_all_gather_plus_reduce_scatter_with_a_fused_scalar():
    """ZeRO-3 on GPU: every block weight gathered in the forward and again in the backward
    (the layer loop keeps no gathered weight), the embedding, head and final norm gathered
    once, every gradient reduce-scattered once: (N-1)/N x 4 x (2 blocks + rest + all)."""
    setup, report = _report(fsdp=N)
    # the precondition: an all-reduce XLA fused from a sliced gradient and a value every
    # device keeps whole (the loss scalar), split by the recount into its two GPU forms
    names = [op.name for op in report.gpu_collectives]
    split = [op for op in report.gpu_collectives if names.count(op.name) == 2]
    assert {op.kind for op in split} == {"reduce-scatter", "all-reduce"}, split
    blocks, rest = _sizes(setup)
    gathered = ring_wire_bytes("all-gather", 4 * (2 * blocks + rest), N)
    scattered = ring_wire_bytes("reduce-scatter", 4 * (blocks + rest), N)
    gpu = report.gpu_collective_totals
    assert gpu["reduce-scatter"]["wire_bytes"] == pytest.approx(scattered, rel=0.01)
    assert gpu["all-reduce"]["wire_bytes"] < 1024  # scalars only: the loss, norm sums
    total = sum(t["wire_bytes"] for t in gpu.values())
    assert total / (gathered + scattered) == pytest.approx(1.0, abs=0.02)
    cpu = sum(t["wire_bytes"] for t in report.collective_totals.values())
    assert cpu / total > 1.3  # the CPU form all-reduces what it then slices
