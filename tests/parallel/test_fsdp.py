"""FSDP (ZeRO-3): which dim of each parameter it splits, and vocab-parallel parity.

Fallback: a ViT-style model has biases and other tensors without an ``embed`` dim; each
parameter is split on its first dim in ``SHARED_ORDER`` that divides; a tensor none of whose
dims divides stays replicated if it has under ``SHARED_MIN_ELEMENTS`` elements and is
refused otherwise (splitting only ``embed`` left them replicated: 1.063x of P*4/N per device).

Vocab parallelism: the embedding table and output projection split on vocab where that moves
fewer bytes (``parallel.fsdp.vocab_parallel_pays``); the lookup is then the explicit
reduce-scatter form of ``shardlib.core.lookup`` and the head's input is gathered over
``fsdp`` only. On data 2 x fsdp 2 x tensor 2 every part of it runs: the token gather and the
reduce-scatter over fsdp, the sum over tensor, and the gradient's sum over data; it must
train exactly like one device.
"""

import math

import jax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib import ParallelPlan, ShardingError, mesh_spec, resolve_spec
from shardlib.core.rules import SHARED_MIN_ELEMENTS
from shardlib.tools.parity import FP32_TOLERANCE, check_parity
from shardlib.train.config import train_config
from shardlib.train.setup import make_setup

# A ViT-like parameter set: shape and logical names of every tensor (no model needed).
VIT = {
    "patch_proj": ((768, 512), (None, "embed")),  # [patch pixels, embed]
    "patch_bias": ((512,), ("embed",)),
    "qkv": ((6, 512, 24, 64), ("layers", "embed", "heads", "head_dim")),
    "qkv_bias": ((6, 24, 128), ("layers", "heads", "head_dim")),  # no embed dim: heads
    "mlp_in": ((6, 512, 4096), ("layers", "embed", "mlp")),
    "mlp_in_bias": ((6, 4096), ("layers", "mlp")),  # no embed dim: mlp
    "mlp_out": ((6, 4096, 512), ("layers", "mlp", "embed")),
    "norm": ((6, 512), ("layers", "embed")),
    "head_bias": ((1000,), (None,)),  # unnamed: replicated
    "gate_bias": ((6, 100), ("layers", "mlp")),  # 600 elements, 100 % 8 != 0: replicated
    "classifier": ((512, 1000), ("embed", None)),
    "tokens": ((1000, 512), ("vocab", "embed")),  # an embedding table: split on vocab
}


def _fsdp8():
    plan = ParallelPlan(mesh=mesh_spec(fsdp=8))
    return plan.rules, plan.mesh_axes


def test_tensors_without_an_embed_dim_fall_back_to_the_next_divisible_dim():
    rules, axes = _fsdp8()
    spec = {n: resolve_spec(n, s, names, rules, axes) for n, (s, names) in VIT.items()}
    assert spec["mlp_in_bias"] == P(None, "fsdp")
    assert spec["qkv_bias"] == P(None, "fsdp")  # heads (24) divides by 8
    assert spec["mlp_in"] == P(None, "fsdp") and spec["mlp_out"] == P(None, None, "fsdp")
    assert spec["tokens"] == P("fsdp")  # vocab before embed
    assert spec["norm"] == P(None, "fsdp") and spec["patch_bias"] == P("fsdp")
    assert spec["gate_bias"] == P()  # small and indivisible: replicated, no error
    assert math.prod(VIT["gate_bias"][0]) < SHARED_MIN_ELEMENTS


def test_per_device_parameter_bytes_are_the_parameters_over_n():
    rules, axes = _fsdp8()
    mesh = mesh_spec(fsdp=8).build()
    total = per_device = 0
    for name, (shape, names) in VIT.items():
        sharding = NamedSharding(mesh, resolve_spec(name, shape, names, rules, axes))
        total += math.prod(shape) * 4
        per_device += math.prod(sharding.shard_shape(shape)) * 4
    # only the unnamed and the indivisible small biases stay whole: well under 1% here
    assert per_device / (total / 8) < 1.01, per_device / (total / 8)


def test_a_dim_that_does_not_divide_passes_the_split_on():
    rules, axes = _fsdp8()
    # embed 500 does not divide by 8: the weight is split on its mlp dim instead
    assert resolve_spec("w", (500, 4096), ("embed", "mlp"), rules, axes) == P(None, "fsdp")
    # nothing divides and the tensor is large: an error that names the dim, not a silent copy
    with pytest.raises(ShardingError, match="dim 0 .'embed', size 20001"):
        resolve_spec("w", (20001, 3), ("embed", None), rules, axes)


def test_the_resolved_spec_places_the_tensor_as_stated():
    rules, axes = _fsdp8()
    mesh = mesh_spec(fsdp=8).build()
    shape, names = VIT["mlp_in_bias"]
    x = jax.device_put(
        jax.numpy.zeros(shape), NamedSharding(mesh, resolve_spec("b", shape, names, rules, axes))
    )
    assert {s.data.shape for s in x.addressable_shards} == {(6, 512)}


# --- vocab-parallel embedding and head ----------------------------------------------------


# vocab 2048 against 2 x 4 sequences x 16 tokens per FSDP group: vocab-parallel pays
CFG = train_config(steps=2, batch=8, seq=16, **{"model.vocab": 2048, "model.layers": 1})


@pytest.mark.slow  # the fast subset keeps the inner loop under 3 minutes
def test_vocab_parallel_head_matches_one_device():
    mesh = mesh_spec(data=2, fsdp=2, tensor=2).build()
    specs = make_setup(CFG, mesh).param_specs
    assert specs["embedding"] == P(("fsdp", "tensor"))  # [vocab, embed]: rows split 4 ways
    assert specs["lm_head"] == P(None, ("fsdp", "tensor"))  # [embed, vocab]
    result = check_parity(CFG, mesh, seed=0)
    assert result.max_rel_loss_err <= FP32_TOLERANCE, result
    assert result.max_rel_grad_err <= FP32_TOLERANCE, result
