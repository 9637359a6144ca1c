"""K/V heads fewer than the tensor degree: replicated over the tensor group (Megatron-LM,
MaxText), the query heads still split.

``parallel.tensor`` marks ``kv_heads`` ``Rules.replicate_indivisible``: a K/V weight or
activation whose head count does not divide by the tensor axis keeps every head on every
device of the group, and the model computes q and k/v as two products there
(``core.layout.splits_alike``) instead of one fused weight that would have to be resharded.
The planner costs the same layout (``terms.base.param_splits`` resolves the real rules;
``Workload.local_kv_heads`` widens its q/k/v activations).

Parity: MQA (1 K/V head) and 2 K/V heads on tensor 2, 4 and 8 give one device's loss and
gradients (fp32, one layer of 8 query heads).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P
from layout_cases import first_devices_mesh

from models.llama.model import Llama, LlamaConfig
from shardlib import ShardingError, mesh_spec, rules_for_mesh
from shardlib.core.layout import shard_model, use_layout
from shardlib.core.resolve import resolve_spec
from shardlib.parallel.plan import ParallelPlan
from shardlib.planner import Workload, candidate, estimate
from shardlib.tools.generate import cache_sharding
from shardlib.tools.parity import FP32_TOLERANCE

KV_NAMES = ("layers", "embed", "kv_heads", "head_dim")
CASES = [(t, kv) for kv in (1, 2) for t in (2, 4, 8) if kv < t]  # kv = t = 2 splits as before


def _loss_and_grads(kv_heads: int, tensor: int):
    """Loss and gradients of one batch through a one-layer Llama of 8 query heads, on
    ``tensor`` devices (1: the reference)."""
    cfg = LlamaConfig(layers=1, heads=8, kv_heads=kv_heads, head_dim=8, embed=32, mlp=64)
    mesh = first_devices_mesh(tensor=tensor)
    rules = ParallelPlan(mesh=mesh_spec(tensor=tensor)).rules
    model = shard_model(lambda: Llama(cfg, nnx.Rngs(0)), mesh, rules)
    graphdef, params = nnx.split(model)
    tokens_BL = np.random.default_rng(0).integers(0, cfg.vocab, (4, 17))

    def loss(params):
        logits_BLV = nnx.merge(graphdef, params)(tokens_BL[:, :-1])
        logp_BLV = jax.nn.log_softmax(logits_BLV)
        return -jnp.take_along_axis(logp_BLV, tokens_BL[:, 1:, None], -1).mean()

    with use_layout(mesh, rules):
        value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return float(value), jax.device_get(nnx.to_pure_dict(grads))


@pytest.fixture(scope="module")
def references():
    return {kv: _loss_and_grads(kv, 1) for kv in (1, 2)}


@pytest.mark.slow
@pytest.mark.parametrize("tensor, kv_heads", CASES)
def test_loss_and_gradient_parity_fp32(tensor, kv_heads, references):
    (want, want_grads), (got, grads) = references[kv_heads], _loss_and_grads(kv_heads, tensor)
    assert abs(got - want) <= FP32_TOLERANCE * abs(want)
    for (path, g), w in zip(
        jax.tree.leaves_with_path(grads), jax.tree.leaves(want_grads), strict=True
    ):
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err <= FP32_TOLERANCE, (jax.tree_util.keystr(path), err)


def test_kv_heads_replicate_only_where_they_do_not_divide():
    rules = rules_for_mesh({"fsdp": 2, "tensor": 4})
    axes = {"fsdp": 2, "tensor": 4}
    wk = [resolve_spec("wk", (2, 64, kv, 8), KV_NAMES, rules, axes) for kv in (1, 2, 4, 8)]
    assert wk == [P(None, "fsdp")] * 2 + [P(None, "fsdp", "tensor")] * 2
    q = resolve_spec("q", (8, 16, 8, 8), ("batch", "seq", "heads", "head_dim"), rules, axes,
                     "activations")  # fmt: skip
    assert q == P("fsdp", None, "tensor")  # the query heads stay split
    k = resolve_spec("k", (8, 16, 1, 8), ("batch", "seq", "kv_heads", "head_dim"), rules, axes,
                     "activations")  # fmt: skip
    assert k == P("fsdp")
    # generate's KV cache [layers, batch, length, kv_heads, head_dim] follows k and v
    mesh = first_devices_mesh(fsdp=2, tensor=4)
    assert cache_sharding(mesh, rules, 4, kv_heads=1).spec == P(None, "fsdp")
    assert cache_sharding(mesh, rules, 4, kv_heads=8).spec == P(None, "fsdp", None, "tensor")
    # other names still refuse what does not divide
    with pytest.raises(ShardingError, match="'heads', size 6"):
        resolve_spec("wq", (64, 6, 8), ("embed", "heads", "head_dim"), rules, axes)


def test_planner_counts_the_replicated_kv_projections():
    """2 K/V heads on tensor=4 are whole on each device: 2·e·d per K and V weight and layer,
    where 4 K/V heads split hold 1·e·d; every other parameter is the same."""
    t, e, d, layers = 4, 4096, 128, 32
    mem = {
        kv: estimate(Workload.from_preset("llama-7b", 8, 512, kv_heads=kv), candidate(tensor=t))
        for kv in (2, 4)
    }
    per_param = 4  # fp32 master weights
    extra = layers * 2 * (2 * e * d - 4 * e * d / t) * per_param
    assert mem[2].memory["params"] - mem[4].memory["params"] == pytest.approx(extra)
    assert mem[2].memory["optimizer"] > mem[4].memory["optimizer"]


@pytest.mark.slow
def test_planner_memory_matches_the_compiled_step_with_replicated_kv_heads():
    """2 K/V heads on tensor=4 (x data=2), compiled from abstract shapes: the planner's
    memory within 10% and its wire bytes within 5% of the compiled step's."""
    from shardlib.planner.validate import validate

    w = Workload.from_preset("llama-small", 16, 64, "fp32", layers=2, kv_heads=2)
    check = validate(w, candidate(data=2, tensor=4))
    assert abs(check.memory_ratio - 1) <= 0.10, check
    assert abs(check.wire_ratio - 1) <= 0.05, check
