"""Pipeline stages: the bubble in FLOPs, uneven stages, any micro-batch count, partitions.

Split from ``test_pipeline.py`` (whose helpers it shares) so that the two files run on
different test workers: each is a few minutes of compiles.
"""

import dataclasses

import pytest
from test_pipeline import _mesh, flops

from benchmarks._programs import layer_stack_program
from shardlib import ShardingError
from shardlib.core.mesh import single_device_mesh
from shardlib.parallel.pipeline.partition import balanced_stages, padded_order
from shardlib.parallel.pipeline.spec import PipelineSpec
from shardlib.tools.parity import check_parity
from shardlib.train.config import override, train_config
from shardlib.train.setup import make_setup

BUBBLE_P = 4
BUBBLE_BASE = train_config(batch=32, seq=32, **{"model.layers": 8})


@pytest.fixture(scope="module")
def stack_flops():
    """FLOPs per device of the layer stack (forward + backward) alone."""

    one_device = {}  # the p = 1 reference is the same program for every case

    def get(p, **overrides):
        if p == 1 and one_device:
            return one_device[1]
        cfg = override(BUBBLE_BASE, overrides)
        setup = make_setup(cfg, _mesh({"stage": p}) if p > 1 else single_device_mesh())
        jitted, args = layer_stack_program(setup)
        result = flops(jitted.lower(*args).compile())
        if p == 1 and not overrides:
            one_device[1] = result
        return result

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,v,m",
    [("gpipe", 1, 4), ("gpipe", 1, 8), ("gpipe", 1, 16), ("circular", 2, 4), ("circular", 2, 16)],
)
def test_bubble_in_flops_matches_the_formula(schedule, v, m, stack_flops):
    """p · FLOPs per device / FLOPs on one device = (v·m + p - 1) / (v·m), within 2%."""
    p = BUBBLE_P
    pipelined = stack_flops(
        p, pipeline_schedule=schedule, virtual_stages=v, pipeline_microbatches=m
    )
    ratio = p * pipelined / stack_flops(1)
    formula = (v * m + p - 1) / (v * m)
    assert abs(ratio / formula - 1) <= 0.02, (ratio, formula)


# Parity through the project's harness (one-device reference from the same random state).
# GPipe is the circular loop at v = 1 (one loop, one stage partition): the circular and
# 1F1B cases cover its uneven stages and its m = 6, at a fraction of the compiles.
UNEVEN_AND_ANY_M = {  # name: (mesh axes, config overrides)
    "1f1b-6-layers-on-4": ({"stage": 4, "data": 2}, {"pipeline_schedule": "1f1b"}),
    "circular-6-layers-on-2x2": (
        {"stage": 2, "data": 2},
        {
            "pipeline_schedule": "circular",
            "virtual_stages": 2,
            "pipeline_microbatches": 2,
            "pipeline_stage_layers": "1,2,2,1",
        },  # interleaved: uneven only when asked
    ),
    # m = 6 on 3 stages: the 1F1B loop; the circular loop's m > p runs in test_pipeline.py
    "1f1b-m6-on-3": ({"stage": 3, "data": 2}, {"pipeline_schedule": "1f1b"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(UNEVEN_AND_ANY_M))
def test_uneven_stages_and_any_microbatch_count_match_one_device(name):
    """6 layers on 4 stages (identity slots on the first and last stage), and m = 6 on 3
    stages (12 sequences, data 2: 6 per replica): loss, gradients and parameters within
    1e-5 of one device."""
    axes, overrides = UNEVEN_AND_ANY_M[name]
    m6 = "m6" in name
    cfg = train_config(
        steps=2,
        batch=12 if m6 else 8,
        seq=16,
        warmup=1,
        **{"model.layers": 6},
        **({"pipeline_microbatches": 6} if m6 else {}),
        **overrides,
    )
    mesh = _mesh(axes)
    if not m6:
        assert len(set(make_setup(cfg, mesh).plan.pipeline.stage_layers)) > 1
    result = check_parity(cfg, mesh, seed=0)
    assert result.ok(), result


def test_interleaved_schedules_refuse_unequal_chunks_with_the_reason():
    """80 layers on 8 stages x 4 virtual stages (146B, v = 4): refused before compiling,
    naming the v that divide, rather than padded to 96 layers (Megatron-LM refuses too)."""
    for schedule in ("1f1b", "circular"):
        spec = PipelineSpec(8, 48, 4, schedule)
        with pytest.raises(
            ShardingError, match=r"16 identity layers.*virtual_stages in \[1, 2, 5, 10\]"
        ):
            spec.check(layers=80, batch=96)
    plan = train_config(**{"model.layers": 6}).parallel.with_mesh_axes({"stage": 2})
    interleaved = dataclasses.replace(plan.pipeline, schedule="1f1b", virtual_stages=2)
    assert interleaved.for_layers(6, plan.mesh_axes).stage_layers == ()  # not balanced


def test_stage_partition_puts_identity_slots_beside_embedding_and_head():
    assert balanced_stages(6, 4) == (1, 2, 2, 1)
    assert balanced_stages(80, 6) == (12, 13, 14, 14, 14, 13)
    assert balanced_stages(48, 2) == (24, 24)
    source, keep, slot_of = padded_order((1, 2, 2, 1))
    assert keep == [1, 0, 1, 1, 1, 1, 1, 0]
    assert [source[s] for s in slot_of] == list(range(6))
    plan = train_config(**{"model.layers": 6}).parallel.with_mesh_axes({"stage": 4})
    assert plan.pipeline.for_layers(6, plan.mesh_axes).stage_layers == (1, 2, 2, 1)
    assert plan.pipeline.for_layers(8, plan.mesh_axes).stage_layers == ()


def test_bad_stage_layers_and_early_reentry_are_clear_errors():
    bad = train_config(pipeline_stage_layers=(1, 1, 2, 1), **{"model.layers": 6})
    with pytest.raises(ShardingError, match="stage_layers"):
        make_setup(bad, _mesh({"stage": 4}))
    cfg = train_config(
        pipeline_schedule="circular",
        virtual_stages=2,
        pipeline_microbatches=2,
        **{"model.layers": 8},
    )
    with pytest.raises(ShardingError, match="at least 4 micro-batches"):
        make_setup(cfg, _mesh({"stage": 4}))
    with pytest.raises(ShardingError, match="pipeline_schedule"):  # refused by train_config
        make_setup(
            train_config(pipeline_schedule="zb-h1", **{"model.layers": 8}),
            _mesh({"stage": 2}),
        )
