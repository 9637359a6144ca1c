"""Context parallelism: its attention kernels, its parity as a layout, its checks and bytes.

Kernels: cheap equivalence on small random q/k/v: each kernel's output and its gradients
(through the hand-written backward passes) must match plain softmax attention to 1e-5, with
and without the causal mask, on context axes of 2, 4 and 8 fake CPU devices.

Layouts: each trains like one device (fp32, 5 steps, llama-tiny with one layer), sharing one
reference trace and initial state. Ulysses moves 4·s·h/N elements per device per layer in
forward (compile only). Under a pipeline: ``test_pipeline_composition.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P
from layout_cases import assert_parity, assert_refused, first_devices_mesh, one_device_reference

from models.llama.rotary import rotary
from shardlib import Rules, ShardingError, base_rules, compose, rules_for_mesh
from shardlib.analysis import explain
from shardlib.core.attention import LocalAttention, chunked_attention, dense_attention
from shardlib.core.layout import use_layout
from shardlib.core.ops import attention, use_ops
from shardlib.parallel import context_parallel
from shardlib.parallel.context import ContextAttention, zigzag_order
from shardlib.tools.parity import FP32_TOLERANCE
from shardlib.train.config import override, train_config
from shardlib.train.loop import run
from shardlib.train.setup import make_setup
from shardlib.train.step import make_loss_fn

B, L, H, G, K = 2, 32, 16, 8, 8  # llama-tiny's heads; L divides 2 x 8 zig-zag chunks
TOL = 1e-5


@pytest.fixture(scope="module")
def qkv():
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (B, L, H, K))
    k = jax.random.normal(keys[1], (B, L, G, K))
    v = jax.random.normal(keys[2], (B, L, G, K))
    do = jax.random.normal(keys[3], (B, L, H, K))  # a random cotangent for the gradients
    return q, k, v, do


def _with_grads(fn, q, k, v, do):
    out, vjp = jax.vjp(fn, q, k, v)
    return (out, *vjp(do))


def _dense(q, k, v, do, causal):
    pos = jnp.arange(L)
    return _with_grads(
        lambda q, k, v: dense_attention(q, k, v, pos, pos, causal=causal), q, k, v, do
    )


def _max_rel(got, want):
    """Largest |error| relative to the largest |value|, over output, dq, dk, dv."""
    return max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, want, strict=True)
    )


def _context_mesh(n):
    return Mesh(np.array(jax.devices()[:n]), ("context",), axis_types=(AxisType.Auto,))


def _run_plan(plan: ContextAttention, n: int, q, k, v, do, causal: bool):
    """The model's entry point under a context mesh, with the plan's token order undone."""
    mesh, rules = _context_mesh(n), compose(base_rules(), context_parallel())
    order = plan.token_order(L)
    order = np.arange(L) if order is None else order
    undo = np.argsort(order)

    def fn(q, k, v):
        with use_layout(mesh, rules), use_ops(attention=plan):
            out = attention(
                q[:, order], k[:, order], v[:, order], jnp.asarray(order), causal=causal
            )
        return out[:, undo]

    return jax.jit(lambda q, k, v, do: _with_grads(fn, q, k, v, do))(q, k, v, do)


@pytest.mark.parametrize("causal", [True, False])
def test_chunked_matches_dense(qkv, causal):
    q, k, v, do = qkv
    pos = jnp.arange(L)
    fn = jax.jit(
        lambda q, k, v, do: _with_grads(
            lambda q, k, v: chunked_attention(q, k, v, pos, pos, causal=causal, chunk=8),
            q,
            k,
            v,
            do,
        )
    )
    assert _max_rel(fn(q, k, v, do), _dense(q, k, v, do, causal)) < TOL


@pytest.mark.parametrize(
    "n", [2, pytest.param(4, marks=pytest.mark.slow), pytest.param(8, marks=pytest.mark.slow)]
)
def test_ring_matches_dense(qkv, n):
    """Zig-zag ring with and without the causal mask; the contiguous causal ring at n=4."""
    q, k, v, do = qkv
    cases = ((True, True), (False, True)) + (((True, False),) if n == 4 else ())
    for causal, balance in cases:
        plan = ContextAttention(kind="ring", load_balance=balance, axis_size=n)
        got = _run_plan(plan, n, q, k, v, do, causal)
        assert _max_rel(got, _dense(q, k, v, do, causal)) < TOL, (causal, balance)


@pytest.mark.parametrize("kind", ["all_to_all", "all_gather"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_gathered_kernels_match_dense(qkv, kind, n):
    q, k, v, do = qkv
    plan = ContextAttention(
        kind=kind, axis_size=n, local=LocalAttention("chunked" if n == 4 else "dense", chunk=8)
    )
    got = _run_plan(plan, n, q, k, v, do, causal=True)
    assert _max_rel(got, _dense(q, k, v, do, True)) < TOL


def test_zigzag_order_balances_causal_work():
    n, seq = 4, 32
    order = zigzag_order(seq, n)
    assert sorted(order) == list(range(seq))
    per_device = order.reshape(n, -1)
    # causal work of a query at position p is p + 1 keys: equal on every device
    work = (per_device + 1).sum(axis=1)
    assert len(set(work.tolist())) == 1
    assert per_device[0].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    with pytest.raises(ShardingError, match="2 x context = 8"):
        zigzag_order(36, 4)


def test_rotary_follows_positions(qkv):
    """RoPE of a permuted sequence with its true positions = the permuted RoPE."""
    q = qkv[0]
    order = zigzag_order(L, 4)
    permuted = rotary(q[:, order], 10_000.0, jnp.asarray(order))
    np.testing.assert_allclose(permuted, rotary(q, 10_000.0)[:, order], rtol=1e-6, atol=1e-6)


def test_ulysses_needs_divisible_heads(qkv):
    q, k, v, _ = qkv
    mesh = _context_mesh(8)
    rules = compose(base_rules(), context_parallel())
    plan = ContextAttention(kind="all_to_all", axis_size=8)
    with pytest.raises(ShardingError, match="kv_heads.*context=8"):
        with use_layout(mesh, rules), use_ops(attention=plan):
            attention(q, k[:, :, :4], v[:, :, :4])


def test_context_attention_needs_seq_rule(qkv):
    q, k, v, _ = qkv
    plan = ContextAttention(kind="ring", axis_size=2)
    with pytest.raises(ShardingError, match="seq -> \\('context',\\)"):
        with use_layout(_context_mesh(2), Rules(activations={"seq": ()})), use_ops(attention=plan):
            attention(q, k, v)


def test_chunked_memory_is_linear_inside_a_layer_scan():
    """Temp bytes of the gradient through a scanned layer: at most linear in s (dense: s²).

    Guards the ``tied`` workaround: without it jax hoisted every block's mask out of the
    model's layer scan and kept them all, which made chunked attention quadratic again.
    """

    def temp(seq):
        pos = jnp.arange(seq)
        q = jax.ShapeDtypeStruct((1, seq, H, K), jnp.float32)
        kv = jax.ShapeDtypeStruct((1, seq, G, K), jnp.float32)

        def loss(q, k, v):
            def layer(x, _):
                return x + chunked_attention(x + q, k, v, pos, pos, chunk=256), None

            out, _ = jax.lax.scan(layer, jnp.zeros(q.shape), None, length=1)
            return jnp.sum(out**2)

        compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, large = temp(512), temp(2048)
    assert large / small < 4, (small, large)  # 4 = linear growth; dense attention gives ~16


# --- as a layout: parity with one device -------------------------------------------------------

CFG = train_config(steps=5, batch=8, seq=32, **{"model.layers": 1})


@pytest.fixture(scope="module")
def reference():
    """(trace, initial host state) on one device with dense attention."""
    return one_device_reference(CFG)


CASES = {
    "ring-cp8": ({"context": 8}, {"attention": "ring"}),
    "all_to_all-cp8": ({"context": 8}, {"attention": "all_to_all"}),
    "all_gather-cp4": ({"context": 4}, {"attention": "all_gather"}),
    "chunked": ({"data": 1}, {"attention_impl": "chunked", "attention_chunk": 8}),
    "dp2-cp2-tp2+sp-ring-chunked": (
        {"data": 2, "context": 2, "tensor": 2},
        {"sequence_parallel": True, "attention_impl": "chunked", "attention_chunk": 4},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_parity_fp32(name):
    assert_parity(CFG, *CASES[name])


# Each kernel at a second context size compares the 5 losses and gradient norms only (one
# compile each); the kernels' gradients at every size (2, 4, 8) are checked above, and ring
# at 2 inside the dp2-cp2-tp2 case.
LOSS_ONLY = [("ring", 4), ("all_to_all", 2), ("all_gather", 8)]


@pytest.mark.slow
@pytest.mark.parametrize("kind, n", LOSS_ONLY)
def test_context_parity_losses(kind, n, reference):
    ref, state = reference
    setup = make_setup(override(CFG, {"attention": kind}), first_devices_mesh(context=n))
    records = run(setup, state=jax.device_put(state, setup.state_shardings), show=False).records
    losses = np.array([r["loss"] for r in records])
    norms = np.array([r["grad_norm"] for r in records])
    np.testing.assert_allclose(losses, ref.losses, rtol=FP32_TOLERANCE, atol=0)
    np.testing.assert_allclose(norms, ref.grad_norms, rtol=FP32_TOLERANCE, atol=0)


def test_resolved_specs():
    cp = rules_for_mesh({"context": 2, "tensor": 2}, sequence_parallel=True)
    assert cp.spec(("batch", "res_seq", "res_embed")) == P(None, ("context", "tensor"))
    assert cp.spec(("batch", "seq", "heads")) == P(None, "context", "tensor")


@pytest.mark.parametrize(
    "axes, overrides, words",
    [
        ({"context": 8}, {"attention": "all_to_all", "model.kv_heads": 4}, ["kv_heads", "ring"]),
        ({"context": 4}, {"seq": 36}, ["2 x context = 8", "load_balance=false"]),
        ({"context": 2}, {"attention": "mesh"}, ["attention='mesh'", "ring"]),
        ({"context": 2}, {"attention_impl": "cudnn"}, ["cuDNN", "all_to_all"]),
    ],
)
def test_bad_configs_raise_before_compiling(axes, overrides, words):
    assert_refused(CFG, axes, overrides, words)


COMM_CFG = train_config(batch=8, seq=32, **{"model.layers": 2})


@pytest.mark.slow
def test_ulysses_all_to_all_bytes_per_layer():
    """Forward: q, k, v and the output each cross once, s·h/N elements per device each."""
    n, mha = 4, {"model.kv_heads": 16}  # MHA, as in the Ulysses paper's formula
    cfg = override(COMM_CFG, {"attention": "all_to_all", **mha})
    setup = make_setup(cfg, first_devices_mesh(context=n))
    loss_fn = make_loss_fn(setup)

    def loss(params, tokens):
        with use_layout(setup.mesh, setup.rules):
            return loss_fn(params, tokens)

    report = explain(
        loss, setup.abstract_state()["params"], setup.abstract_batch(), mesh=setup.mesh
    )
    per_layer = sum(
        op.buffer_bytes for op in report.collectives if op.kind == "all-to-all" and op.count == 2
    )
    h = 16 * 8
    formula = 4 * cfg.dataset.batch * cfg.dataset.seq * h // n * jnp.dtype(jnp.float32).itemsize
    assert abs(per_layer / formula - 1) < 0.05, (per_layer, formula)
