"""2.5D tensor parallelism (Tesseract, ``shardlib/parallel/tensor25d.py``) on d x q x q meshes.

Parity: d = 1 (2 x 2, the 2D case) and d = 2 (2 x 2 x 2) train like one device (fp32,
5 steps, loss and gradients within 1e-5).

Wire bytes (compile only, nothing runs), per layer and device, GPU form of the compiled HLO
(``explain``'s ``gpu_collectives``), each collective assigned to a product (qkv, attention
out, gate/up, down) by what it moves (a weight's gather by its result's shape, an
activation's by its width; ties by the einsum in its metadata, else the module in its source
line) and to one of Tesseract's terms (``parallel/tensor25d_traffic.py``). The same on jax
0.10.2 and 0.12, which puts the weights' gathers at the stacked weights' per-layer slice
(metadata: ``dynamic_index_in_dim``, no einsum); there summa's X for dW of qkv and gate/up
(the one normed residual, gathered at the saved activations' slice) is checked as their sum.
llama-tiny, 2 layers, b=8, s=32 (B = 256 tokens), fp32, q = 2; bytes for d = 1 / d = 2
(the same on both jax versions):

| term (per layer) | paper | HLO | HLO / paper |
| --- | --- | --- | --- |
| weight forward, 4 products (all-gather tensor2) | 73728 | 73728 | 1.000 |
| weight for dX, 4 products (all-gather tensor2) | 73728 | 73728 | 1.000 |
| dW reduce, fused (reduce-scatter tensor2) | 73728 | 73728 | 1.000 |
| dW over depth, fused (all-reduce tensor_depth) | 0 / 73728 | 0 / 73728 | - / 1.000 |
| X forward, qkv + gate/up (all-gather tensor) | 32768 / 16384 | 32768 / 16384 | 1.000 |
| dX reduce, qkv and gate/up (reduce-scatter tensor) | 16384 / 8192 each | same | 1.000 |
| X for dW, qkv + gate/up | 32768 / 16384 | 0 (gathered X kept) | - |
| X forward, dX reduce, X for dW of attention out (m = 128) | 3 x 32768 / 16384 | 0 | - |
| the same of down (m = 256) | 3 x 65536 / 32768 | 0 | - |
| Y reduce, attention out and down (n = 64) | 0 | 16384 / 8192 each | GSPMD term 1.000 |
| dY gather, attention out and down (n = 64) | 0 | 32768 / 8192, 16384 / 8192 | 2 / 1 x term |
| norms' statistics | - | 3328 / 1664 | - |
| whole layer | 614400 / 491520 | 371968 / 362112 | 0.605 / 0.737 |
| whole layer, ``products = "summa"`` | 614400 / 491520 | 617728 / 493184 | 1.005 / 1.003 |

So the whole-layer ratio is the algorithm's, not a miscount: every weight term and every
activation term of the column products is the paper's to the byte; the row products (their
weights laid out transposed by the logical-name rules) reduce their output instead of
broadcasting their wider input, and dW reuses the forward's gathered X. The GSPMD terms sum
to 352256 / 360448 (plus at d = 1 XLA's second dY gather of the out projection, 16384):
HLO / that = 1.009 / 1.005. Parameters per device: 180864 = 1.002 x Ψ·e/q² at both d.
Parity (5 steps): loss 1.5e-7, gradient norm 6.6e-8 / 6.2e-8, gradients 5.0e-7 / 4.8e-7.

``products = "summa"`` (every product as Tesseract's SUMMA): each of the terms above, of
every product, is the paper's to the byte (1.000) at d = 1 and d = 2, the row products'
three X terms included and X for dW gathered again for every product; the whole layer is
1.005 / 1.003 of the paper, the norms' statistics (3328 / 1664) the only bytes beside.
"""

import math
from functools import cache

import jax
import pytest
from jax.sharding import PartitionSpec as P
from layout_cases import assert_parity, assert_refused, first_devices_mesh

from shardlib import rules_for_mesh
from shardlib.analysis import explain
from shardlib.core.mesh import mesh_spec
from shardlib.parallel.plan import ParallelPlan
from shardlib.parallel.tensor import TensorParallel
from shardlib.parallel.tensor25d_traffic import (
    WEIGHT_TERMS,
    Product,
    megatron_terms,
    summa_terms,
    tesseract_terms,
    workload_products,
)
from shardlib.train.config import override, train_config
from shardlib.train.setup import make_setup

CFG = train_config(steps=5, batch=8, seq=32, **{"model.layers": 1})
MODE = {"mode": "2.5d"}
SUMMA = {**MODE, "products": "summa"}  # every product as Tesseract's SUMMA
D1 = {"tensor2": 2, "tensor": 2}  # d = 1: the 2D grid
D2 = {"tensor_depth": 2, "tensor2": 2, "tensor": 2}  # [d, q, q] = [2, 2, 2]


@pytest.mark.parametrize(
    "axes, form",
    [(D1, MODE), (D2, MODE), (D1, SUMMA), (D2, SUMMA)],
    ids=["d1-2x2", "d2-2x2x2", "d1-summa", "d2-summa"],
)
def test_parity_fp32(axes, form):
    assert_parity(CFG, axes, form)


# --- rules and refusals --------------------------------------------------------------------------


def test_resolved_specs():
    rules = rules_for_mesh(D2)
    assert rules.spec(("embed", "mlp"), "params") == P("tensor2", "tensor")
    assert rules.spec(("mlp", "embed"), "params") == P("tensor", "tensor2")
    assert rules.spec(("vocab", "embed"), "params") == P("tensor", "tensor2")
    batch = ("tensor_depth", "tensor2")
    assert rules.spec(("batch", "res_seq", "res_embed")) == P(batch, None, "tensor")
    assert rules.spec(("batch", "seq", "mlp")) == P(batch, None, "tensor")
    summa = ParallelPlan(mesh=mesh_spec(**D2), tensor=TensorParallel(products="summa")).rules
    assert summa.spec(("layers", "mlp", "embed"), "params") == P(None, "tensor2", "tensor")
    assert summa.spec(("heads", "head_dim", "embed"), "params") == P("tensor2", None, "tensor")
    assert summa.spec(("embed", "mlp"), "params") == P("tensor2", "tensor")
    assert summa.spec(("batch", "res_seq", "res_embed")) == P(batch[::-1], None, "tensor")


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
        ({"tensor": 4}, {"products": "summa"}, ["products='summa'", "1d", "mode='2.5d'"]),
    ],
    ids=["not-qxq", "mode-vs-mesh", "bad-mode", "mlp-indivisible", "batch", "sp", "summa-1d"],
)
def test_bad_configs_raise_before_compiling(axes, overrides, words):
    assert_refused(CFG, axes, overrides, words)


# --- bytes and memory against the formulas (compile only) ---------------------------------------

COMM_CFG = train_config(batch=8, seq=32, **{"model.layers": 2})
LAYERS = 2
E = 4  # fp32


@cache
def _report(axes_items, products="megatron"):
    axes = dict(axes_items)
    setup = make_setup(
        override(COMM_CFG, {**MODE, "products": products}), first_devices_mesh(**axes)
    )
    state = setup.abstract_state()
    report = explain(setup.train_step, state, setup.abstract_batch(), params=state["params"])
    return setup, report


def _layer_weight_bytes(setup) -> int:
    """Bytes of one layer's weight matrices (the stacked blocks' leaves of rank >= 3)."""
    leaves = jax.tree.leaves(setup.param_shapes["blocks"])
    return sum(math.prod(x.shape[1:]) * E for x in leaves if x.ndim >= 3)


EINSUMS = {
    "bld,dgjk->blgjk": "qkv",
    "blhk,hkd->bld": "attention out",
    "bld,djf->bljf": "gate/up",
    "blf,fd->bld": "down",
}  # the products' einsums in ``models/llama`` (op_name metadata of the HLO)
MODULES = {"Attention": ("qkv", "attention out"), "MLP": ("gate/up", "down")}  # in ``source``


def _weights(m) -> dict[str, tuple[int, ...]]:
    """Each product's weight, one layer's, unsplit: its einsum's second operand."""
    g = m.kv_heads
    return {
        "qkv": (m.embed, g, m.heads // g + 2, m.head_dim),  # q's heads of a group, k, v
        "attention out": (m.heads, m.head_dim, m.embed),
        "gate/up": (m.embed, 2, m.mlp),
        "down": (m.mlp, m.embed),
    }


def _split_once(shape, weight, q) -> bool:
    """``shape`` is ``weight`` gathered over tensor2 and still split q ways over tensor."""
    if len(shape) != len(weight):
        return False
    ratios = sorted(w / s for w, s in zip(weight, shape, strict=True))
    return ratios == [1.0] * (len(weight) - 1) + [q]


def _term(op, products, weights, held, q):
    """(product, term) of one per-layer collective of the compiled step, ``None`` for the
    norms' statistics; "layer" where XLA fuses a term of every product into one op.

    The product is told by what the op moves, not by where XLA put it: a weight's gather by
    its result's shape (jax 0.12 gathers at the stacked weights' per-layer slice, whose
    metadata names no einsum), an activation's by its width (``held`` tokens per device);
    ties by the einsum in the metadata, else the module in ``source`` (jax 0.12 names a row
    product's dY gather after the layout constraint behind it). Where nothing tells them
    apart (the column products' X, the one normed residual), the product is the tuple."""
    backward = "transpose(" in op.op_name
    kind, axes = op.kind, op.axes
    if axes == ("tensor_depth",) and kind == "all-reduce":
        return "layer", "dW over depth"
    if axes == ("tensor2",) and kind == "reduce-scatter" and backward:
        return "layer", "dW reduce"
    if axes == ("tensor2",) and kind == "all-gather":
        term = "weight for dX" if backward else "weight forward"
        found = [p for p, w in weights.items() if op.shapes and _split_once(op.shapes[-1], w, q)]
    elif axes == ("tensor",) and kind in ("all-gather", "reduce-scatter"):
        width = op.buffer_bytes / (held * E)  # the activation's feature width
        if kind == "reduce-scatter":
            term, side = ("dX reduce", "m") if backward else ("Y reduce", "n")
        elif not backward:
            term, side = "X forward", "m"
        elif "x_for_dW[" in op.op_name or "dynamic_index_in_dim" in op.op_name:
            # summa's X gathered again (``tensor25d.summa_product``); jax 0.12 gathers at
            # the backward loop's slice of the activations the forward saved
            term, side = "X for dW", "m"
        else:
            term, side = "dY gather", "n"
        found = [p.name for p in products if getattr(p, side) == width]
    else:
        return None
    einsum = [p for s, p in EINSUMS.items() if s in op.op_name]
    module = [ps for name, ps in MODULES.items() if f" in {name}." in op.source]
    for narrower in (einsum, *module):
        if len(found) > 1 and set(found) & set(narrower):
            found = [p for p in found if p in narrower]
    if not found:
        return None
    return (found[0] if len(found) == 1 else tuple(found)), term


def _measured(setup, report, q, d) -> tuple[dict, float]:
    """Per-layer wire bytes by (product, term), and the bytes no term claims."""
    products = workload_products(setup.workload)
    weights = _weights(setup.workload)
    assert [math.prod(weights[p.name]) for p in products] == [p.m * p.n for p in products]
    held = COMM_CFG.dataset.batch * COMM_CFG.dataset.seq // (d * q)  # batch over depth, tensor2
    by_term: dict[tuple, float] = {}
    left = 0.0
    for op in report.gpu_collectives:
        if op.count != LAYERS:
            continue
        key = _term(op, products, weights, held, q)
        if key is None:
            left += op.wire_bytes
        else:
            by_term[key] = by_term.get(key, 0.0) + op.wire_bytes
    return by_term, left


def _products(got, term) -> set[str]:
    """The products that have bytes of ``term``."""
    keys = [k[0] if isinstance(k[0], tuple) else (k[0],) for k in got if k[1] == term]
    return {name for key in keys for name in key}


def _check(got, term, formulas, names) -> None:
    """``term`` of each of ``names`` against its formula: alone, or summed with the products
    it could not be told from (a tuple key of ``_term``); every name must be found."""
    found = set()
    for (product, t), value in got.items():
        group = product if isinstance(product, tuple) else (product,)
        if t == term and set(group) & set(names):
            assert _close(value, sum(formulas[n][term] for n in group)), (group, term)
            found |= set(group)
    assert found >= set(names), (term, names, found)


def _close(measured, formula) -> bool:
    assert abs(measured - formula) <= 0.05 * formula, (measured, formula)
    return True


@pytest.mark.parametrize(
    "axes, products",
    [(D1, "megatron"), (D2, "megatron"), (D1, "summa"), (D2, "summa")],
    ids=["d1", "d2", "d1-summa", "d2-summa"],
)
def test_each_collective_against_tesseracts_term(axes, products):
    """Per product and term (``parallel/tensor25d_traffic.py``). Summa: every term of every
    product is the paper's within 5%, and so is the whole layer. Megatron: where it runs
    the paper's collective, the HLO's bytes are the paper's within 5%; where it runs another
    (row products, dW's reuse of the gathered X), they are the megatron term's."""
    setup, report = _report(tuple(axes.items()), products)
    d, q = axes.get("tensor_depth", 1), axes["tensor"]
    tokens = COMM_CFG.dataset.batch * COMM_CFG.dataset.seq
    products_ = workload_products(setup.workload)
    assert sum(p.m * p.n for p in products_) * E == _layer_weight_bytes(setup)
    paper = {p.name: tesseract_terms(tokens, p, q=q, d=d, e=E) for p in products_}
    got, left = _measured(setup, report, q, d)
    total = sum(got.values()) + left
    assert left < 0.02 * total, (left, total)  # the norms' statistics
    paper_total = sum(sum(t.values()) for t in paper.values())
    print(f"{products} d={d}: whole layer HLO / paper = {total / paper_total:.3f}")
    names = [p.name for p in products_]
    for term in WEIGHT_TERMS[:2]:  # the weight terms: the paper's collectives, per product
        _check(got, term, paper, names)
        assert not any(isinstance(k[0], tuple) for k in got if k[1] == term)  # told apart
    for term in WEIGHT_TERMS[2:]:  # fused by XLA over the layer's four gradients
        want = sum(paper[p.name][term] for p in products_)
        if want:
            assert _close(got[("layer", term)], want)
        else:
            assert ("layer", term) not in got
    columns = [p.name for p in products_ if not p.row]
    rows = [p.name for p in products_ if p.row]
    _check(got, "X forward", paper, columns)  # the normed residual, one gather each
    if products == "summa":
        summa = {p.name: summa_terms(tokens, p, q=q, d=d, e=E) for p in products_}
        for term in ("dX reduce", "X for dW"):
            _check(got, term, summa, names)
        _check(got, "X forward", summa, rows)
        assert not _products(got, "Y reduce") | _products(got, "dY gather")
        assert _close(total, paper_total)  # 1.005 / 1.003: the norms' statistics
        return
    megatron = {p.name: megatron_terms(tokens, p, q=q, d=d, e=E) for p in products_}
    # the paper's dX reduce of the column products; its X-for-dW broadcast is not run (X kept)
    _check(got, "dX reduce", paper, columns)
    assert not _products(got, "X for dW")
    assert _products(got, "X forward") == set(columns)
    # d = 1: XLA (jax 0.10.2 and 0.12) gathers the out projection's dY twice (two
    # transposes of "blhk,hkd->bld", not merged), one more (q-1)·B·n·e/(dq²)
    extra = megatron["attention out"]["dY gather"] if d == 1 else 0.0
    dy = {
        **megatron,
        "attention out": {"dY gather": megatron["attention out"]["dY gather"] + extra},
    }
    # the row products: output-wide moves instead of the paper's three
    _check(got, "Y reduce", megatron, rows)
    _check(got, "dY gather", dy, rows)
    assert _products(got, "Y reduce") == _products(got, "dY gather") == set(rows)
    # the whole layer against the paper's count: the ratio is the terms' (0.605 / 0.737)
    megatron_total = sum(sum(t.values()) for t in megatron.values())
    assert megatron_total < paper_total
    assert _close(total, megatron_total + extra)


def test_param_memory_is_one_over_q_squared():
    for axes, products in ((D1, "megatron"), (D2, "megatron"), (D2, "summa")):
        setup, report = _report(tuple(axes.items()), products)
        q = axes["tensor"]
        whole = sum(math.prod(x.shape) * E for x in jax.tree.leaves(setup.param_shapes))
        held = sum(t.bytes_per_device for t in report.tensors if t.is_param)
        assert abs(held / (whole / q**2) - 1) < 0.05, (axes, held, whole)


@pytest.mark.parametrize("q, d", [(2, 1), (2, 2), (4, 2), (8, 4)])
def test_tesseract_terms_are_colossal_ais_bandwidth_entry(q, d):
    """With B·m = m·n = M and no depth term, the paper's six SUMMA terms sum to Colossal-AI's
    3(q-1)(d+1)/(dq) in units of M·e/q (REFERENCE.md's 2.5D row; d = 1: 2D's 6(q-1)/q)."""
    side = 64
    terms = tesseract_terms(side, Product("p", side, side, row=False), q=q, d=d, e=E)
    unit = side * side * E / q
    summa = sum(terms.values()) - terms["dW over depth"]
    assert summa / unit == pytest.approx(3 * (q - 1) * (d + 1) / (d * q))
