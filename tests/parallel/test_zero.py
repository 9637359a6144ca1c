"""ZeRO stages 0-3, HSDP and optimizer offload: layouts, parity with one device, and the
compiled step's memory and traffic against the ZeRO table (compile-only, abstract shapes).

Parity runs (``shardlib.tools.parity`` from its ``random_state``) compare losses, gradient norms
and the parameters after the last step with one shared one-device run. Gradient
accumulation sums the same per-example terms (the core's
``test_accumulation_equals_the_full_batch``), so accumulated runs are held to the
unaccumulated reference.
"""

import jax
import pytest
from jax.sharding import PartitionSpec as P

from benchmarks.zero_figures import zero_figures
from shardlib import ShardingError, mesh_spec
from shardlib.parallel.offload import HOST_MEMORY
from shardlib.tools import parity
from shardlib.train.config import override, train_config
from shardlib.train.setup import make_setup

# factored_min_dim only matters to adafactor: it is set here so that the optimizer tests
# share this config's one-device reference.
CFG = train_config(steps=5, batch=16, seq=16, factored_min_dim=32, **{"model.layers": 1})


def check_parity(cfg, axes, ref_cfg):
    setup = make_setup(cfg, mesh_spec(**axes).build())
    got = parity.trace(setup, parity.random_state(setup), grads=False, params=True)
    result = parity.compare_traces(got, parity.one_device(ref_cfg))
    assert result.ok(), result
    return setup, got


# Without accumulation, zero=0 and zero=3 on data=8 are the core's dp8 and fsdp8 parity tests
# (the FSDP rules on another axis name); the default optimizer is adamw.
CASES = {
    "zero0": ({"data": 8}, 0),
    "zero1": ({"data": 8}, 1),
    "zero2": ({"data": 8}, 2),
    "zero3": ({"data": 8}, 3),
    "hsdp2x4": ({"data": 2, "fsdp": 4}, 0),
}


PARITY = [(n, m) for n in CASES for m in (1, 2) if (n, m) not in (("zero0", 1), ("zero3", 1))]


@pytest.mark.slow
@pytest.mark.parametrize("name,microbatches", PARITY)
def test_zero_parity(name, microbatches):
    axes, stage = CASES[name]
    cfg = override(CFG, {"zero": stage, "data_microbatches": microbatches})
    setup, result = check_parity(cfg, axes, ref_cfg=CFG)
    # the trained state really is laid out as the stage says
    mu = result.state["opt_state"][1][0].mu["blocks"]["mlp"]["w_up"]  # [layers, embed, mlp]
    assert mu.sharding.spec == setup.opt_state_shardings[1][0].mu["blocks"]["mlp"]["w_up"].spec
    if stage:
        assert "data" in str(mu.sharding.spec) and mu.addressable_shards[0].data.shape[1] == 8


def specs_of(cfg, **axes):
    setup = make_setup(cfg, mesh_spec(**axes).build())
    pick = lambda tree: tree["blocks"]["mlp"]["w_up"].spec  # noqa: E731  [layers, embed, mlp]
    adam = setup.opt_state_shardings[1][0]
    return pick(setup.param_shardings), pick(setup.grad_shardings), pick(adam.mu)


def test_zero_stages_shard_state_roles_over_data():
    assert specs_of(CFG, data=8) == (P(), P(), P())
    sharded = P(None, "data")
    for stage, want in {1: (P(), P(), sharded), 2: (P(), sharded, sharded)}.items():
        assert specs_of(override(CFG, {"zero": stage}), data=8) == want
    assert specs_of(override(CFG, {"zero": 3}), data=8) == (sharded,) * 3
    # HSDP: shard over fsdp, replicate over data; ZeRO-1 on top splits the state over both
    hsdp = P(None, "fsdp")
    assert specs_of(CFG, data=2, fsdp=4) == (hsdp,) * 3
    both = P(None, ("data", "fsdp"))
    assert specs_of(override(CFG, {"zero": 1}), data=2, fsdp=4) == (hsdp, hsdp, both)


def test_zero_without_a_data_axis_is_a_clear_error():
    with pytest.raises(ShardingError, match="zero=1.*'data'.*fsdp"):
        make_setup(override(CFG, {"zero": 1}), mesh_spec(fsdp=8).build())
    with pytest.raises(ShardingError, match="zero=4"):
        override(CFG, {"zero": 4})


@pytest.mark.slow
def test_offloaded_optimizer_state_lives_in_host_memory():
    cfg = override(CFG, {"zero": 2, "offload_optimizer": True})
    _, result = check_parity(cfg, {"data": 8}, ref_cfg=CFG)
    opt_leaves = [x for x in jax.tree.leaves(result.state["opt_state"]) if x.ndim]
    assert opt_leaves and all(x.sharding.memory_kind == HOST_MEMORY for x in opt_leaves)
    assert result.state["params"]["embedding"].sharding.memory_kind == "device"


# Compile-only: the ZeRO table (fp32 Adam, N = 8). The benchmark prints the same figures for
# llama-small (benchmarks/zero.py); the ratios do not depend on the model's size.
@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,offload", [(0, False), (1, False), (2, False), (3, False), (2, True)]
)
def test_zero_memory_and_traffic_vs_the_zero_table(stage, offload):
    cfg = override(CFG, {"zero": stage, "offload_optimizer": offload})
    figures = zero_figures(make_setup(cfg, mesh_spec(data=8).build()), devices=8)
    assert abs(figures.memory_ratio - 1) <= 0.10, figures
    totals = figures.report.collective_totals
    psi_bytes = 4 * figures.params
    if stage == 0:  # one all-reduce of the gradients: exactly the ring formula
        assert set(totals) == {"all-reduce"}
        assert abs(figures.wire_ratio - 1) <= 0.05
    elif stage in (1, 2):  # all-reduce (CPU's reduce-scatter) of grads + all-gather of params
        assert abs(totals["all-reduce"]["buffer_bytes"] / psi_bytes - 1) <= 0.05
        assert abs(totals["all-gather"]["buffer_bytes"] / psi_bytes - 1) <= 0.05
        assert abs(figures.wire_ratio - 1) <= 0.05
    else:  # gathers in forward and backward; the embedding tables are gathered only once
        assert 1.5 <= totals["all-gather"]["buffer_bytes"] / psi_bytes <= 2.0
        assert 0.8 <= figures.wire_ratio <= 1.0
    if offload:  # the optimizer state (8Ψ/N) left device memory for pinned host memory
        assert abs(figures.host_state_bytes / (8 * figures.params / 8) - 1) <= 0.05
