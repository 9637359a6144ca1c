"""2.5D tensor parallelism (Tesseract, ``shardlib/parallel/tensor25d.py``) on d x q x q meshes.

Parity: d = 1 (2 x 2, the 2D case) and d = 2 (2 x 2 x 2) train like one device (fp32,
5 steps, loss and gradients within 1e-5).

Formulas (compile only, nothing runs; the module docstring derives them), per layer and
device, GPU form of the compiled HLO (``explain``'s ``gpu_collectives``), B tokens, h the
width, e = 4 bytes, W the layer's weight bytes:

- weights over ``tensor2``: 3(q-1)·W/q², Tesseract's weight term (Wang et al. 2021;
  Colossal-AI's ``Matmul_*_2p5D``: one broadcast pass forward, one in each backward product);
- weight gradients over ``tensor_depth``: 2(d-1)/d·W/q² (the all-reduce over the layers);
- activations over ``tensor``: 8(q-1)·B·h·e/(dq²) (gather + reduce-scatter of the residual
  per block, forward and backward): falls as 1/d, as Tesseract's activation term does;
- parameters per device: Ψ·e/q² (Colossal-AI's 2.5D table, parameters O(1/q²)).

Measured (jax 0.10.2, CPU, llama-tiny with 2 layers, b=8, s=32, so B·h·e = 65536 B and
W = 294912 B per layer; q = 2), bytes per layer and device:

| figure | d = 1 | d = 2 | formula d = 1 / d = 2 | ratio d = 1 / d = 2 |
| --- | --- | --- | --- | --- |
| weights over tensor2 | 221440 | 221184 | 221184 / 221184 | 1.001 / 1.000 |
| gradients over tensor_depth | 0 | 73728 | 0 / 73728 | - / 1.000 |
| activations over tensor | 150528 | 66816 | 147456 (9 moves) / 65536 | 1.021 / 1.020 |
| whole layer | 371968 | 362112 | 368640 / 360448 | 1.009 / 1.005 |
| Tesseract's (1) + depth term | | | 614400 / 491520 | 0.605 / 0.737 |
| parameters per device | 180864 | 180864 | Ψ·e/q² = 180544 | 1.002 / 1.002 |

The last bytes row is the paper's SUMMA count (activation term over the layer's four
products, Σm = 512): the GSPMD form moves its weight bytes exactly and fewer activation
bytes (it pairs the products Megatron's way, so only the residual's width moves).
Parity (5 steps): loss 1.5e-7, gradient norm 6.6e-8 / 6.2e-8, gradients 5.0e-7 / 4.8e-7.
"""

import math
from functools import cache

import jax
import pytest
from jax.sharding import PartitionSpec as P
from layout_cases import assert_parity, assert_refused, first_devices_mesh

from shardlib import rules_for_mesh
from shardlib.analysis import explain
from shardlib.parallel.tensor25d import summa_wire_bytes
from shardlib.train.config import override, train_config
from shardlib.train.setup import make_setup

CFG = train_config(steps=5, batch=8, seq=32, **{"model.layers": 1})
MODE = {"mode": "2.5d"}
D1 = {"tensor2": 2, "tensor": 2}  # d = 1: the 2D grid
D2 = {"tensor_depth": 2, "tensor2": 2, "tensor": 2}  # [d, q, q] = [2, 2, 2]


@pytest.mark.parametrize("axes", [D1, D2], ids=["d1-2x2", "d2-2x2x2"])
def test_parity_fp32(axes):
    assert_parity(CFG, axes, MODE)


# --- rules and refusals --------------------------------------------------------------------------


def test_resolved_specs():
    rules = rules_for_mesh(D2)
    assert rules.spec(("embed", "mlp"), "params") == P("tensor2", "tensor")
    assert rules.spec(("mlp", "embed"), "params") == P("tensor", "tensor2")
    assert rules.spec(("vocab", "embed"), "params") == P("tensor", "tensor2")
    batch = ("tensor_depth", "tensor2")
    assert rules.spec(("batch", "res_seq", "res_embed")) == P(batch, None, "tensor")
    assert rules.spec(("batch", "seq", "mlp")) == P(batch, None, "tensor")


@pytest.mark.parametrize(
    "axes, overrides, words",
    [
        (
            {"tensor_depth": 1, "tensor2": 2, "tensor": 4},
            {},
            ["d x q x q", "tensor=4", "Fix: use tensor_depth=2, tensor2=2, tensor=2"],
        ),
        ({"tensor": 8}, MODE, ["mode='2.5d'", "tensor_depth x tensor2 x tensor", "Fix"]),
        ({**D2}, {"mode": "2.5"}, ["not a tensor-parallel form", "2.5d"]),
        ({**D2}, {"model.mlp": 129}, ["'mlp'", "tensor=2", "not divisible", "Fix"]),
        ({**D2}, {"batch": 6}, ["'batch'", "tensor_depth=2 x tensor2=2", "Fix"]),
        ({**D2}, {"sequence_parallel": True}, ["2.5D", "drop one"]),
    ],
    ids=["not-qxq", "mode-vs-mesh", "bad-mode", "mlp-indivisible", "batch", "sp"],
)
def test_bad_configs_raise_before_compiling(axes, overrides, words):
    assert_refused(CFG, axes, overrides, words)


# --- bytes and memory against the formulas (compile only) ---------------------------------------

COMM_CFG = train_config(batch=8, seq=32, **{"model.layers": 2})
LAYERS = 2
E = 4  # fp32


@cache
def _report(axes_items):
    axes = dict(axes_items)
    setup = make_setup(override(COMM_CFG, MODE), first_devices_mesh(**axes))
    state = setup.abstract_state()
    report = explain(setup.train_step, state, setup.abstract_batch(), params=state["params"])
    return setup, report


def _layer_weight_bytes(setup) -> int:
    """Bytes of one layer's weight matrices (the stacked blocks' leaves of rank >= 3)."""
    leaves = jax.tree.leaves(setup.param_shapes["blocks"])
    return sum(math.prod(x.shape[1:]) * E for x in leaves if x.ndim >= 3)


def _per_layer_by_axes(report) -> dict[str, float]:
    out: dict[str, float] = {}
    for op in report.gpu_collectives:
        if op.count == LAYERS:
            key = ",".join(op.axes)
            out[key] = out.get(key, 0.0) + op.wire_bytes
    return out


@pytest.mark.parametrize("axes", [D1, D2], ids=["d1", "d2"])
def test_wire_bytes_per_layer_match_formulas(axes):
    setup, report = _report(tuple(axes.items()))
    d, q = axes.get("tensor_depth", 1), axes["tensor"]
    w = _layer_weight_bytes(setup)
    tokens = COMM_CFG.dataset.batch * COMM_CFG.dataset.seq
    bhe = tokens * setup.workload.embed * E
    by_axes = _per_layer_by_axes(report)
    weights = by_axes.get("tensor2", 0.0)
    assert abs(weights / (3 * (q - 1) * w / q**2) - 1) < 0.05, (weights, w)
    depth = by_axes.get("tensor_depth", 0.0)
    assert abs(depth - 2 * (d - 1) / d * w / q**2) <= 0.05 * w / q**2, (depth, w)
    # the residual's gathers and reduce-scatters (plus the norms' small sums): 8 per layer;
    # at d = 1 XLA's partitioner (jax 0.10.2) gathers the out projection's dY twice in the
    # backward (two transposes of "blhk,hkd->bld", not merged): one more (q-1)·B·h·e/q²
    gathers = 8 + (1 if d == 1 else 0)
    activations = by_axes.get("tensor", 0.0)
    formula_act = gathers * (q - 1) * bhe / (d * q**2)
    assert abs(activations / formula_act - 1) < 0.05, (activations, formula_act)
    total = sum(by_axes.values())
    formula = (3 * (q - 1) + 2 * (d - 1) / d) * w / q**2 + formula_act
    assert abs(total / formula - 1) < 0.05, (by_axes, formula)
    # Tesseract's (1) over the layer's four products: the same weight bytes, more activation
    # bytes than the GSPMD pairing moves (see the table above)
    m = setup.workload
    qkv, attn = (m.heads + 2 * m.kv_heads) * m.head_dim, m.heads * m.head_dim
    products = [(m.embed, qkv), (attn, m.embed), (m.embed, 2 * m.mlp), (m.mlp, m.embed)]
    summa = [summa_wire_bytes(tokens, a, b, q=q, d=d, e=E) for a, b in products]
    assert abs(weights / sum(s[1] for s in summa) - 1) < 0.05
    assert activations < sum(s[0] for s in summa)


def test_param_memory_is_one_over_q_squared():
    for axes in (D1, D2):
        setup, report = _report(tuple(axes.items()))
        q = axes["tensor"]
        whole = sum(math.prod(x.shape) * E for x in jax.tree.leaves(setup.param_shapes))
        held = sum(t.bytes_per_device for t in report.tensors if t.is_param)
        assert abs(held / (whole / q**2) - 1) < 0.05, (axes, held, whole)


@pytest.mark.parametrize("q, d", [(2, 1), (2, 2), (4, 2), (8, 4)])
def test_formula_1_is_colossal_ais_bandwidth_entry(q, d):
    """With B·m = m·n = M, (1) is Colossal-AI's 3(q-1)(d+1)/(dq) in units of M·e/q
    (REFERENCE.md's 2.5D row; d = 1: 2D's 6(q-1)/q)."""
    side = 64
    activations, weights = summa_wire_bytes(side, side, side, q=q, d=d, e=E)
    unit = side * side * E / q
    assert (activations + weights) / unit == pytest.approx(3 * (q - 1) * (d + 1) / (d * q))
