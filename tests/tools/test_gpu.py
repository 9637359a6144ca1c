"""What only a real GPU can show: cuDNN attention, fp32 parity with the CPU, host offload.

Skipped where JAX has no GPU (CI, this repository's CPU machines). On a GPU machine run
``JAX_PLATFORMS=cuda,cpu pytest tests/tools/test_gpu.py -o addopts=""``: the GPU is the default
backend and the CPU backend stays available for the reference run (the suite's conftest
keeps ``JAX_PLATFORMS=cpu`` otherwise).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.gpu_attention import attention_fn, fwd_bwd, packed_rows, rel_err
from shardlib.core.mesh import MeshSpec
from shardlib.tools import parity
from shardlib.train.config import train_config
from shardlib.train.setup import make_setup


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


pytestmark = pytest.mark.skipif(not _gpus(), reason="needs a GPU (JAX_PLATFORMS=cuda,cpu)")

CFG = dict(steps=3, batch=4, seq=64, compile_cache="off")


def _mesh(platform: str):
    return MeshSpec((("data", 1),)).build(jax.devices(platform)[:1])


def _trace(cfg, platform: str, **kw):
    setup = make_setup(cfg, _mesh(platform))
    return setup, parity.trace(setup, parity.random_state(setup), **kw)


def _memory(setup, state):
    """``memory_analysis`` of the train step compiled for this state (its memory kinds)."""
    return setup.train_step.lower(state, setup.abstract_batch()).compile().memory_analysis()


def test_cudnn_attention_matches_dense():
    """cuDNN's fused kernel against dense attention in fp32 (same bf16 inputs): its error is
    no larger than bf16 dense attention's own, output and the three input gradients
    (the kernels and the error are ``benchmarks/gpu_attention.py``'s)."""
    b, seq, h, g, d = 2, 512, 8, 4, 64
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (b, seq, h, d), jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, seq, g, d), jnp.bfloat16) for key in keys[1:3])
    do = jax.random.normal(keys[3], (b, seq, h, d), jnp.bfloat16)
    want = fwd_bwd(attention_fn("dense", seq, jnp.float32))(q, k, v, do.astype(jnp.float32))

    def err(impl):
        got = fwd_bwd(attention_fn(impl, seq))(q, k, v, do)
        return max(rel_err(a, w) for a, w in zip(got, want, strict=True))

    dense, cudnn = err("dense"), err("cudnn")
    assert cudnn <= max(dense, 1e-3) * 2, (cudnn, dense)


def test_packed_documents_through_cudnn_match_packed_dense():
    """Four documents a row, causal within each: cuDNN with the document mask against
    packed dense attention in fp32, output and the three input gradients, within bf16
    dense attention's own error."""
    b, seq, h, g, d = 2, 512, 8, 4, 64
    packed, _ = packed_rows(b, seq)
    keys = jax.random.split(jax.random.key(2), 4)
    q = jax.random.normal(keys[0], (b, seq, h, d), jnp.bfloat16)
    k, v = (jax.random.normal(key, (b, seq, g, d), jnp.bfloat16) for key in keys[1:3])
    do = jax.random.normal(keys[3], (b, seq, h, d), jnp.bfloat16)
    reference = fwd_bwd(attention_fn("dense", seq, jnp.float32, packed))
    want = reference(q, k, v, do.astype(jnp.float32))

    def err(impl):
        got = fwd_bwd(attention_fn(impl, seq, packed=packed))(q, k, v, do)
        return max(rel_err(a, w) for a, w in zip(got, want, strict=True))

    dense, cudnn = err("dense"), err("cudnn")
    assert cudnn <= max(dense, 1e-3) * 2, (cudnn, dense)


def test_auto_picks_cudnn_on_the_gpu():
    """The default, with nothing set: bf16 on a GPU runs cuDNN and says so; fp32 dense."""
    bf16 = make_setup(train_config(**CFG, precision="bf16"), _mesh("gpu"))
    assert bf16.plan.context.attention_impl == "cudnn", bf16.attention
    fp32 = make_setup(train_config(**CFG), _mesh("gpu"))
    assert fp32.plan.context.attention_impl == "dense" and "fp32" in fp32.attention.reason


def test_cudnn_attention_trains_like_dense():
    cfg = train_config(**CFG, precision="bf16", attention_impl="dense")
    _, dense = _trace(cfg, "gpu", grads=False)
    _, cudnn = _trace(
        train_config(**CFG, precision="bf16", attention_impl="cudnn"), "gpu", grads=False
    )
    np.testing.assert_allclose(cudnn.losses, dense.losses, rtol=2e-3)


def test_fp32_training_on_the_gpu_matches_the_cpu():
    """Parity's first law across backends: the same fp32 steps on the GPU and on one CPU
    device, at JAX's default matmul precision (on an H200, jax 0.11.2, first-step gradients
    came within 1.1e-7 of the CPU's; under ``default_matmul_precision("highest")``, 8.9e-4)."""
    cfg = train_config(**CFG)
    _, gpu = _trace(cfg, "gpu", params=True)
    _, cpu = _trace(cfg, "cpu", params=True)
    result = parity.compare_traces(gpu, cpu)
    assert result.ok(), result


def test_optimizer_offload_keeps_state_in_pinned_host_memory_and_trains_the_same():
    cfg = train_config(**CFG)
    _, plain = _trace(cfg, "gpu", grads=False, params=True)
    setup, offloaded = _trace(
        train_config(**CFG, offload_optimizer=True), "gpu", grads=False, params=True
    )
    assert parity.compare_traces(offloaded, plain).ok(1e-6)
    leaves = [x for x in jax.tree.leaves(offloaded.state["opt_state"]) if x.ndim]
    assert leaves and all(x.sharding.memory_kind == "pinned_host" for x in leaves)
    # the compiled step reads and writes the state in host memory (the GPU reports it)
    assert _memory(setup, offloaded.state).host_argument_size_in_bytes > 0


def test_offloaded_residuals_go_to_host_and_train_the_same():
    # both programs at full fp32 precision: at JAX's default (which lets XLA pick a faster
    # fp32 algorithm per matmul) the two differed by 1.1e-4 in the first step's gradients
    # on an H200 with jax 0.11.2; under "highest" they agree to 1e-5
    with jax.default_matmul_precision("highest"):
        _, plain = _trace(train_config(**CFG, remat="none"), "gpu", params=True)
        setup, offloaded = _trace(
            train_config(**CFG, remat="offload:mlp_hidden"), "gpu", params=True
        )
    assert parity.compare_traces(offloaded, plain).ok(), parity.compare_traces(offloaded, plain)
    host = _memory(setup, offloaded.state).host_temp_size_in_bytes
    assert host > 0, "the offloaded residuals should live in host memory during the step"


def test_fp8_projections_become_fp8_gemms():
    """``precision=fp8`` puts a quantize-dequantize pattern around each block projection
    (``train/fp8.py``); on Hopper XLA rewrites it into cuBLAS FP8 GEMMs. The compiled step
    of a small Llama must call them (the custom call's target names f8), not run the
    products in bf16 after dequantizing."""
    cfg = train_config(**CFG, precision="fp8", model="llama-small")
    setup = make_setup(cfg, _mesh("gpu"))
    text = setup.train_step.lower(setup.abstract_state(), setup.abstract_batch()).compile()
    targets = sorted(set(re.findall(r'custom_call_target="([^"]+)"', text.as_text())))
    if float(jax.devices("gpu")[0].compute_capability) < 8.9:
        pytest.skip(f"FP8 GEMMs need compute capability 8.9+, not on this GPU ({targets})")
    assert any("f8" in t for t in targets), targets
