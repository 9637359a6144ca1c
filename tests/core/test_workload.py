"""``Workload``: one description of the model and step, read from the model's own inventory
and routing (``core.model.Routed``), for the plan's checks, the trainer and the planner."""

import pytest

from shardlib.core.capabilities import ExpertRouting
from shardlib.core.inventory import inventory
from shardlib.core.model import resolve_model
from shardlib.core.workload import Workload


def test_a_moe_workload_takes_its_routing_from_the_model():
    """moe-tiny with 4 layers, every 2nd an MoE layer: 2 stacked groups of 2 decoder layers."""
    w = Workload.from_preset("moe-tiny", 8, 32, "fp32", layers=4, moe_every=2, top_k=1)
    cfg = w.cfg
    assert w.routing == cfg.routing()
    assert (w.layers, w.blocks, w.moe_layers, w.moe_every) == (4, 2, 2, 2)
    assert (w.experts, w.top_k, w.group_tokens) == (cfg.experts, 1, 32)
    assert w.capacity == cfg.capacity(32)
    assert w.slots_per_token == w.experts * w.capacity / 32
    assert (w.mlp, w.expert_mlp) == (cfg.mlp, cfg.expert_mlp)  # dense and expert widths apart
    assert w.block_stats and "attn_q" in w.checkpoint_names


def test_a_dense_workload_has_no_routing():
    w = Workload.from_preset("llama-tiny", 8, 32, layers=3)
    assert w.routing is None and not w.block_stats
    assert (w.layers, w.blocks) == (3, 3)
    assert (w.experts, w.top_k, w.moe_every, w.moe_layers, w.capacity) == (0, 1, 0, 0, 0)
    assert w.group_tokens == 32 and w.slots_per_token == 0.0


def test_the_step_splits_into_micro_batches():
    factory = resolve_model("llama-tiny")
    w = Workload.from_factory(factory, 16, 32, inv=inventory(factory), microbatches=4)
    assert (w.global_batch, w.microbatches, w.micro_batch) == (16, 4, 4)
    assert w.param_count == inventory(factory).param_count


def test_from_params_reads_the_stack_and_the_routing_given():
    """A model of one's own, by its ``(path, shape, names)`` entries."""
    entries = [
        ("embedding", (100, 8), ("vocab", "embed")),
        ("blocks.attn.wq", (3, 8, 4, 2), ("layers", "embed", "heads", "head_dim")),
        ("blocks.moe.w_up", (3, 4, 8, 16), ("layers", "expert", "embed", "mlp")),
    ]
    routing = ExpertRouting(experts=4, top_k=2, capacity_factor=1.0, dim="expert", every=2)
    w = Workload.from_params(entries, routing=routing, global_batch=6, seq=16, microbatches=3)
    assert (w.blocks, w.layers, w.micro_batch) == (3, 6, 2)
    assert w.dims["heads"] == 4 and w.expert_mlp == 16 and "mlp" not in w.dims
    assert w.param_count == 800 + 3 * 64 + 3 * 512
    dense = Workload.from_params(entries[:2])
    assert (dense.blocks, dense.layers, dense.experts) == (3, 3, 0)
    assert dense.global_batch == dense.seq == 1


@pytest.mark.parametrize("name", ["llama-tiny", "moe-tiny"])
def test_equal_workloads_hash_alike(name):
    assert hash(Workload.from_preset(name, 8, 32)) == hash(Workload.from_preset(name, 8, 32))
