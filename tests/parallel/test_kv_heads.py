"""K/V heads fewer than the tensor degree: replicated over the tensor group (Megatron-LM,
MaxText), the query heads still split.

``parallel.tensor`` marks ``kv_heads`` ``Rules.replicate_indivisible``: a K/V weight or
activation whose head count does not divide by the tensor axis keeps every head on every
device of the group, and the model computes q and k/v as two products there
(``core.layout.splits_alike``) instead of one fused weight that would have to be resharded.
The planner costs the same layout (``terms.base.param_splits`` resolves the real rules;
``Workload.local_kv_heads`` widens its q/k/v activations).

Parity: MQA (1 K/V head) and 2 K/V heads on tensor 2, 4 and 8 train like one device (fp32,
2 steps, one layer of 8 query heads).
"""

import pytest
from jax.sharding import PartitionSpec as P
from layout_cases import assert_parity, first_devices_mesh

from shardlib import ShardingError, rules_for_mesh
from shardlib.core.rules import resolve_spec
from shardlib.planner import Workload, candidate, estimate
from shardlib.tools.generate import cache_sharding
from shardlib.train.config import train_config

KV_NAMES = ("layers", "embed", "kv_heads", "head_dim")


def _cfg(kv_heads: int):
    overrides = {"model.layers": 1, "model.heads": 8, "model.kv_heads": kv_heads}
    return train_config(steps=2, batch=8, seq=16, **overrides)


CASES = [(t, kv) for kv in (1, 2) for t in (2, 4, 8) if kv < t]  # kv = t = 2 splits as before


@pytest.mark.parametrize(
    "tensor, kv_heads",
    [pytest.param(t, kv, marks=pytest.mark.slow) for t, kv in CASES],
)
def test_parity_fp32(tensor, kv_heads):
    assert_parity(_cfg(kv_heads), {"tensor": tensor}, {})


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
