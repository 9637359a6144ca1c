"""Logical-axis rules: resolved PartitionSpecs per strategy, and errors before compilation."""

import pytest
from jax.sharding import PartitionSpec as P

from shardlib import (
    ParallelPlan,
    Rules,
    ShardingError,
    base_rules,
    compose,
    load_mesh,
    mesh_spec,
    resolve_spec,
    rules_for_mesh,
)
from shardlib.core.workload import Workload
from shardlib.parallel import data_parallel, fsdp, tensor_parallel
from shardlib.parallel.plan import suggest_presets
from shardlib.train.config import parse_overrides, train_config
from shardlib.train.setup import make_setup

TINY = train_config(steps=1, batch=8, seq=16)


def specs_on(**axes):
    setup = make_setup(TINY, mesh_spec(**axes).build())
    return setup.param_specs, setup.rules


def test_data_parallel_replicates_params_and_splits_batch():
    specs, rules = specs_on(data=8)
    assert specs["blocks"]["attn"]["wq"] == P()
    assert rules.spec(("batch", "seq", "embed")) == P("data")


def test_fsdp_shards_weights_along_embed_and_the_vocab_tables_along_vocab():
    specs, rules = specs_on(fsdp=8)
    assert specs["embedding"] == P("fsdp")  # [vocab, embed]: vocab-parallel lookup
    assert specs["lm_head"] == P(None, "fsdp")  # [embed, vocab]
    assert specs["blocks"]["attn"]["wq"] == P(None, "fsdp")  # [layers, embed, heads, hd]
    assert specs["blocks"]["attn"]["wo"] == P(None, None, None, "fsdp")  # [layers, h, hd, e]
    assert specs["blocks"]["mlp"]["w_down"] == P(None, None, "fsdp")
    assert specs["final_norm"]["scale"] == P("fsdp")
    assert rules.spec(("batch",)) == P("fsdp")
    assert rules.spec(("batch", "seq", "vocab")) == P(None, None, "fsdp")  # logits


def test_tensor_parallel_is_column_then_row():
    specs, rules = specs_on(tensor=8)
    assert specs["blocks"]["attn"]["wq"] == P(None, None, "tensor")  # column: heads
    assert specs["blocks"]["attn"]["wk"] == P(None, None, "tensor")  # column: kv heads
    assert specs["blocks"]["attn"]["wo"] == P(None, "tensor")  # row: heads in
    assert specs["blocks"]["mlp"]["w_up"] == P(None, None, "tensor")  # column: mlp
    assert specs["blocks"]["mlp"]["w_down"] == P(None, "tensor")  # row: mlp in
    assert specs["embedding"] == P("tensor")  # vocab-parallel
    assert specs["lm_head"] == P(None, "tensor")
    assert rules.spec(("batch",)) == P()


def test_three_d_composes_all_three():
    specs, rules = specs_on(data=2, fsdp=2, tensor=2)
    assert specs["blocks"]["mlp"]["w_gate"] == P(None, "fsdp", "tensor")
    assert rules.spec(("batch", "seq", "embed")) == P(("data", "fsdp"))


def test_compose_refuses_an_axis_claimed_twice():
    with pytest.raises(ShardingError, match="'batch' gets mesh axis 'data'"):
        compose(data_parallel(), fsdp(axis="data"))


def test_composition_order_is_argument_order():
    rules = compose(base_rules(), fsdp(), data_parallel())
    assert rules.activations["batch"] == ("fsdp", "data")
    assert rules.params["embed"] == ("fsdp",)
    assert tensor_parallel().params["vocab"] == ("tensor",)


AXES = {"data": 2, "fsdp": 2, "tensor": 2}


@pytest.mark.parametrize(
    "shape, names, rules, axes, needles",
    [
        # unknown logical name
        (
            (8, 8),
            ("embed", "hidden"),
            rules_for_mesh(AXES),
            AXES,
            ["blocks.w", "dim 1", "'hidden'", "Fix"],
        ),
        # rank mismatch
        (
            (8, 8, 8),
            ("embed", "mlp"),
            rules_for_mesh(AXES),
            AXES,
            ["blocks.w", "rank 3", "2 names"],
        ),
        # mesh axis used twice in one spec
        (
            (8, 8),
            ("embed", "mlp"),
            base_rules().replace(params={"embed": "fsdp", "mlp": "fsdp"}),
            AXES,
            ["blocks.w", "'fsdp'", "dim 0", "dim 1", "Fix"],
        ),
        # not divisible (the fix names presets that fit)
        (
            (6, 8),
            ("heads", "embed"),
            rules_for_mesh({"tensor": 8}),
            {"tensor": 8},
            ["blocks.w", "dim 0", "size 6", "tensor=8", "Fix"],
        ),
        # rule names an axis the mesh lacks
        (
            (8, 8),
            ("mlp", "embed"),
            base_rules().replace(params={"mlp": "tensor"}),
            {"data": 2, "fsdp": 4},
            ["blocks.w", "dim 0", "'tensor'", "lacks"],
        ),
        # two axes whose product does not divide
        (
            (4, 8),
            ("embed", "mlp"),
            base_rules().replace(params={"embed": ("data", "fsdp", "tensor")}),
            AXES,
            ["dim 0", "size 4", "data=2 x fsdp=2 x tensor=2", "8 ways"],
        ),
    ],
)
def test_bad_annotations_name_tensor_dim_and_axis(shape, names, rules, axes, needles):
    with pytest.raises(ShardingError) as err:
        resolve_spec("blocks.w", shape, names, rules, axes, "params")
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


def test_not_divisible_suggests_presets_that_fit():
    with pytest.raises(ShardingError, match="Presets that fit: .*cpu-8-dp"):
        with suggest_presets():
            resolve_spec("w", (6,), ("heads",), rules_for_mesh({"tensor": 8}), {"tensor": 8})


def _suggested(message: str) -> set[str]:
    listed = message.partition("Presets that fit: ")[2].rstrip(".")
    return {name.strip() for name in listed.split(",") if name.strip()}


def test_suggested_presets_fit_the_batch_and_never_ping_pong():
    """batch=3 on cpu-8-dp once suggested cpu-8-fsdp, which failed the same way and
    suggested cpu-8-dp back: every suggestion must itself accept the failing batch."""

    def check(preset: str) -> None:
        plan = ParallelPlan.from_mesh_spec(load_mesh(preset))
        plan.check(Workload.from_params({}, global_batch=3, seq=16))

    for preset in ("cpu-8-dp", "cpu-8-fsdp"):
        with pytest.raises(ShardingError) as err:
            check(preset)
        fits = _suggested(str(err.value))
        assert fits and {"cpu-8-dp", "cpu-8-fsdp", "cpu-8-hsdp"}.isdisjoint(fits), fits
        for other in fits:  # each suggestion passes the very check that failed
            check(other)


def test_suggested_presets_fit_the_weight_and_the_batch():
    axes = {"tensor": 8}
    with pytest.raises(ShardingError) as err:
        with suggest_presets(batch=3):
            resolve_spec("w", (6,), ("heads",), rules_for_mesh(axes), axes)
    fits = _suggested(str(err.value))
    assert "cpu-8-dp" not in fits and "cpu-8-tp" not in fits, fits  # batch 3; heads 6


def test_rules_check_mesh_names_rule_and_axis():
    with pytest.raises(ShardingError, match="'heads' -> \\('tensor',\\) names mesh axis 'tensor'"):
        Rules(params={"heads": "tensor"}).check_mesh({"data": 8})


@pytest.mark.parametrize(
    "overrides, axes, needles",
    [
        # 4 K/V heads on tensor=8 are replicated (parallel.tensor); 12 query heads do not split
        (["model.heads=12", "model.kv_heads=4"], {"tensor": 8}, ["'heads', size 12", "tensor=8"]),
        (["model.mlp=102"], {"fsdp": 2, "tensor": 4}, ["params.blocks.mlp", "'mlp'", "size 102"]),
        (["batch=6"], {"data": 4, "fsdp": 2}, ["micro-batch of 6", "data=4 x fsdp=2"]),
        (["batch=8", "data_microbatches=4"], {"data": 8}, ["micro-batch of 2", "data=8"]),
        # the data strategy checks its split when the plan meets the model and the batch
        (["batch=10", "data_microbatches=4"], {"data": 8}, ["not divisible by microbatches"]),
        (["model.vocab=250"], {"tensor": 8}, ["embedding", "'vocab'", "size 250"]),
    ],
)
def test_configs_that_do_not_fit_the_mesh(overrides, axes, needles):
    cfg = parse_overrides(overrides, TINY)
    with pytest.raises(ShardingError) as err:
        make_setup(cfg, mesh_spec(**axes).build())
    for needle in needles:
        assert needle in str(err.value), (needle, str(err.value))


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["steps=many"], "expected int"),
        (["nonsense=1"], "no setting 'nonsense'"),
        (["precision=fp4"], "precision='fp4'.*fp8"),
        (["microbatches=4"], "ambiguous.*parallel.data.microbatches"),
        (["steps"], "not NAME=VALUE"),
    ],
)
def test_bad_overrides(overrides, needle):
    with pytest.raises(ShardingError, match=needle):
        parse_overrides(overrides)


def test_bad_model_fields():
    with pytest.raises(ValueError, match="kv_heads"):
        make_setup(parse_overrides(["model.kv_heads=5"], TINY), mesh_spec(data=8).build())
    with pytest.raises(ShardingError, match="no field 'depth'.*Fix"):
        make_setup(parse_overrides(["model.depth=5"], TINY), mesh_spec(data=8).build())


def test_a_stacked_bias_is_judged_per_layer_by_fsdp():
    """GPT-3 175B's key bias [layers 96, kv_heads 96, head_dim 128] on fsdp=256 x tensor=2:
    no dim divides by 512, and one layer's slice (12,288 elements) is under
    ``SHARED_MIN_ELEMENTS``, so FSDP leaves it replicated, as the planner (which counts per
    layer) assumed; a stacked weight whose layer is large still fails, naming the dim."""
    axes = {"fsdp": 256, "tensor": 2}
    rules = rules_for_mesh(axes)
    names = ("layers", "kv_heads", "head_dim")
    assert resolve_spec("blocks.attn.bk", (96, 96, 128), names, rules, axes) == P(None, "tensor")
    with pytest.raises(ShardingError, match="dim 1 \\('kv_heads', size 96\\)"):
        resolve_spec("blocks.w", (96, 96, 200), names, rules, axes)
