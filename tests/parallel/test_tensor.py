"""Megatron tensor parallelism's forms beyond 1D: sequence parallelism (Megatron-SP) and 2D/3D
tensor parallelism.

Parity: each layout trains like one device (fp32, 5 steps, llama-tiny with one layer).
One reference trace and initial state serve every layout (``layout_cases``).

Communication (compile only, nothing runs): Megatron-SP moves the bytes of plain TP per
layer with its all-reduces turned into all-gathers and reduce-scatters.
"""

import pytest
from jax.sharding import PartitionSpec as P
from layout_cases import assert_parity, assert_refused, first_devices_mesh

from shardlib import rules_for_mesh
from shardlib.analysis.reduce_scatter import gpu_collectives
from shardlib.train.config import override, train_config
from shardlib.train.setup import make_setup

CFG = train_config(steps=5, batch=8, seq=32, **{"model.layers": 1})


CASES = {
    "tp4+sp": ({"tensor": 4}, {"sequence_parallel": True}),
    "2d-2x2": ({"tensor": 2, "tensor2": 2}, {}),
    "2d-2x4": ({"tensor": 2, "tensor2": 4}, {}),
    "3d-2x2x2": ({"tensor": 2, "tensor2": 2, "tensor3": 2}, {}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_parity_fp32(name):
    assert_parity(CFG, *CASES[name])


# --- rules -------------------------------------------------------------------------------------


def test_resolved_specs():
    sp = rules_for_mesh({"tensor": 4}, sequence_parallel=True)
    assert sp.spec(("batch", "res_seq", "res_embed")) == P(None, "tensor")
    assert sp.spec(("batch", "seq", "heads")) == P(None, None, "tensor")
    two = rules_for_mesh({"tensor": 2, "tensor2": 2})
    assert two.spec(("embed", "mlp"), "params") == P("tensor2", "tensor")
    assert two.spec(("batch", "res_seq", "res_embed")) == P("tensor2", None, "tensor")
    three = rules_for_mesh({"tensor": 2, "tensor2": 2, "tensor3": 2})
    assert three.spec(("embed", "heads"), "params") == P(("tensor2", "tensor3"), "tensor")


@pytest.mark.parametrize(
    "axes, overrides, words",
    [
        ({"data": 2}, {"sequence_parallel": True}, ["tensor axis", "sequence_parallel=false"]),
        ({"tensor": 2, "tensor2": 2}, {"sequence_parallel": True}, ["2D/2.5D/3D", "drop one"]),
    ],
)
def test_bad_configs_raise_before_compiling(axes, overrides, words):
    assert_refused(CFG, axes, overrides, words)


# --- communication (compile only) ---------------------------------------------------------------

COMM_CFG = train_config(batch=8, seq=32, **{"model.layers": 2})


def _layer_collectives(setup):
    """Collectives inside the layer scan (run once per layer), as a GPU would run them."""
    text = setup.train_step.lower(setup.abstract_state(), setup.abstract_batch()).compile()
    layers = dict(setup.cfg.model_overrides)["layers"]
    return [op for op in gpu_collectives(text.as_text(), setup.mesh) if op.count == layers]


@pytest.mark.slow
def test_sequence_parallel_moves_tp_bytes_without_all_reduce():
    mesh = first_devices_mesh(tensor=4)
    tp = _layer_collectives(make_setup(COMM_CFG, mesh))
    sp = _layer_collectives(make_setup(override(COMM_CFG, {"sequence_parallel": True}), mesh))
    activation = COMM_CFG.dataset.batch * COMM_CFG.dataset.seq * 64 * 4  # b·s·h fp32 bytes
    assert sorted(op.kind for op in tp) == ["all-reduce"] * 4  # 2 forward, 2 backward
    assert all(op.buffer_bytes == activation for op in tp)
    kinds = sorted(op.kind for op in sp if op.buffer_bytes == activation)
    assert kinds == ["all-gather"] * 4 + ["reduce-scatter"] * 4
    # what stays an all-reduce is the norms' scale gradient ([embed] per norm), as in Megatron
    assert all(op.buffer_bytes <= 2 * 64 * 4 for op in sp if op.kind == "all-reduce")
    tp_wire, sp_wire = (sum(op.wire_bytes for op in ops) for ops in (tp, sp))
    assert abs(sp_wire / tp_wire - 1) < 0.05, (sp_wire, tp_wire)
