"""remat=none's saved activations: booked by definition for GPUs, and the definition is the
model's (the residuals autodiff keeps for shardlib's block), so neither drifts silently."""

from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.activation_bytes import LLAMA_7B, block_residuals, booked_per_layer
from models.llama.model import LlamaConfig
from models.llama.swiglu import plain, swiglu
from shardlib.planner import load_cluster
from shardlib.planner.cost.terms.remat import KEPT


def test_a_gpu_books_the_7b_block_by_definition():
    """Llama 7B, bf16, cuDNN attention: 5h + q/k/v + 3 mlp elements per token per layer
    (~32 bytes per h, Korthikanti et al.'s 34); the CPU backend keeps its fitted count."""
    h, mlp = LLAMA_7B.embed, LLAMA_7B.mlp
    by_definition = (5 * h + 3 * h + 3 * mlp) * 2 / h  # bf16 bytes per token per h
    gpu, est = booked_per_layer(cluster=load_cluster("a100-8"))
    assert gpu == pytest.approx(by_definition, rel=0.03) and gpu < 40
    assert est.fits  # the published 8-GPU no-recompute runs fit in 80 GB
    cpu, _ = booked_per_layer(backend="cpu")
    assert cpu > 1.1 * gpu  # fitted on XLA:CPU (fp32 residuals)
    simulated, _ = booked_per_layer(cluster=load_cluster("cpu-8-small"))
    assert simulated == pytest.approx(cpu)  # a cluster of CPU devices is the CPU backend


def test_kept_none_is_what_the_block_saves():
    """The residuals jax lists for one block (bf16, a fused kernel's set) by width: h, the
    attention output's and q's (heads x head_dim), k's and v's, the MLP's; all bf16 but the
    kernel's fp32 row statistics (heads per token)."""
    cfg = LlamaConfig(embed=48, heads=4, kv_heads=2, head_dim=16, mlp=80)
    q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    rows = [r for r in block_residuals(cfg, jnp.bfloat16, 2, 24) if r.per_token]
    widths = Counter(int(r.per_token) for r in rows)
    kept = KEPT["none"]
    assert widths == {
        cfg.embed: kept["h"],
        q: kept["q"] + kept["qkv"],  # the attention output; q
        kv: 2 * kept["qkv"],  # k, v
        cfg.mlp: kept["mlp"],
        cfg.heads: 1,  # the kernel's log-sum-exp
    }, rows
    assert {r.dtype for r in rows if r.per_token != cfg.heads} == {"bfloat16"}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_swiglu_keeps_the_gradients_of_the_plain_form(dtype):
    gate, up, g = (jax.random.normal(jax.random.key(i), (2, 8, 24), dtype) for i in range(3))
    ref = jax.vjp(plain, gate, up)
    kept = jax.vjp(swiglu, gate, up)
    np.testing.assert_array_equal(ref[0], kept[0])
    for a, b in zip(ref[1](g), kept[1](g), strict=True):
        np.testing.assert_array_equal(a, b)
