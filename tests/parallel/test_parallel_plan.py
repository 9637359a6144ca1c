"""``ParallelPlan``: one description of a layout, read from a mesh file and from settings.

Nothing here compiles: the plan's tables, its rules and the settings' short forms are data.
"""

import pytest
from jax.sharding import PartitionSpec as P

from shardlib import ParallelPlan, ShardingError, load_mesh, mesh_spec
from shardlib.train.config import canonical_key, parse_overrides, train_config

PIPELINE_TOML = """# Use this when: a test
[mesh]
stage = 2
fsdp = 4

[parallel.pipeline]
schedule = "circular"
microbatches = 4
virtual_stages = 2

[parallel.remat]
policy = "full"
"""


def plan_from(tmp_path, text: str) -> ParallelPlan:
    path = tmp_path / "plan.toml"
    path.write_text(text)
    return ParallelPlan.from_mesh_spec(load_mesh(path))


def test_a_mesh_file_is_read_straight_into_the_sections(tmp_path):
    plan = plan_from(tmp_path, PIPELINE_TOML)
    assert plan.mesh_axes == {"stage": 2, "fsdp": 4}
    assert (plan.pipeline.schedule, plan.pipeline.microbatches) == ("circular", 4)
    assert plan.pipeline.virtual_stages == 2 and plan.remat.policy == "full"
    assert plan.tables() == {
        "pipeline": {"schedule": "circular", "microbatches": 4, "virtual_stages": 2},
        "remat": {"policy": "full"},
    }
    spec = plan.pipeline_spec()
    assert (spec.stages, spec.microbatches, spec.iterations()) == (2, 4, 2 * 4 + 2 - 1)


@pytest.mark.parametrize(
    "table, needle",
    [
        ("[parallel.pipe]\nschedule = 'gpipe'", "unknown table \\[parallel.pipe\\].*pipeline"),
        ("[parallel.pipeline]\nstages = 2", "no setting 'stages'.*schedule, microbatches"),
        ("[parallel.pipeline]\nmicrobatches = 'four'", "microbatches='four'.*expected int"),
        ("[parallel.pipeline]\nschedule = 'zb-h1'", "pipeline_schedule='zb-h1'.*gpipe"),
        ("[parallel.data]\nzero = true", "zero=True.*expected int"),
        ("[parallel.context]\nattention = 'tree'", "attention='tree'"),
    ],
)
def test_bad_parallel_tables_name_the_setting_and_the_fix(tmp_path, table, needle):
    with pytest.raises(ShardingError, match=needle):
        plan_from(tmp_path, "[mesh]\ndata = 8\n\n" + table + "\n")


def test_a_boolean_axis_size_is_refused(tmp_path):
    with pytest.raises(ShardingError, match="axis 'data' has size True"):
        plan_from(tmp_path, "[mesh]\ndata = true\n")


def test_the_plan_composes_the_rules_of_every_axis():
    plan = ParallelPlan(mesh=mesh_spec(data=2, fsdp=2, expert=2))
    # the batch over the batch-splitting axes, outer first, expert folded in last (GShard)
    assert plan.rules.spec(("batch", None)) == P(("data", "fsdp", "expert"))
    assert plan.rules.spec(("expert", "embed"), "params") == P("expert", "fsdp")
    assert plan.rules.activations["batch_no_expert"] == ("data", "fsdp")
    zero1 = train_config(zero=1).parallel
    assert zero1.with_devices(8).state_rules.opt_state.params["embed"] == ("data",)


def test_a_minus_one_axis_is_resolved_against_the_devices():
    plan = ParallelPlan(mesh=mesh_spec(data=-1, tensor=2))
    with pytest.raises(ShardingError, match="-1 until the plan meets its devices"):
        plan.mesh_axes  # noqa: B018
    assert plan.with_devices(8).mesh_axes == {"data": 4, "tensor": 2}


@pytest.mark.parametrize(
    "word, full",
    [
        ("run.steps", "run.steps"),
        ("steps", "run.steps"),  # a field alone
        ("zero", "parallel.data.zero"),
        ("schedule", "optimizer.schedule"),  # training sections before parallel ones
        ("pipeline_schedule", "parallel.pipeline.schedule"),  # section_field
        ("checkpoint_dir", "checkpoint.dir"),
        ("data_microbatches", "parallel.data.microbatches"),
        ("optimizer", "optimizer.name"),  # a section alone: its first field
        ("precision", "precision.compute"),
        ("remat", "parallel.remat.policy"),
        ("data", "dataset.path"),
    ],
)
def test_short_forms_are_derived_from_the_sections(word, full):
    assert canonical_key(word, train_config()) == full


def test_settings_and_the_plan_meet_in_one_config():
    cfg = parse_overrides(["steps=7", "pipeline_schedule=1f1b", "model.layers=4", "lr=0.01"])
    assert cfg.run.steps == 7 and cfg.optimizer.lr == 0.01
    assert cfg.parallel.pipeline.schedule == "1f1b"
    assert cfg.model_overrides == (("layers", "4"),)


def test_the_sections_declare_the_mesh_axes_and_the_names_they_bring():
    # the mesh axes a plan accepts are the union of the sections' declarations
    assert set(ParallelPlan.known_axes()) == {
        "data",
        "fsdp",
        "tensor",
        "tensor2",
        "tensor3",
        "tensor_depth",
        "context",
        "expert",
        "stage",
    }
    assert set(ParallelPlan.logical_names()) == {"stage", "batch_no_expert"}
    rules = ParallelPlan(mesh=mesh_spec(stage=2, data=2, expert=2)).rules
    assert rules.params["stage"] == ("stage",)
    assert rules.activations["batch_no_expert"] == ("data",)  # batch minus the expert axis
    with pytest.raises(ShardingError) as err:
        ParallelPlan(mesh=mesh_spec(pipeline=8))
    message = str(err.value)
    assert "unknown mesh axis 'pipeline'" in message
    assert "stage (pipeline stages" in message  # names the axes there are, and what they do


def test_the_old_schedule_name_bounded_is_an_alias_of_1f1b():
    from shardlib.parallel.pipeline.gpipe import PipelineParallel

    assert PipelineParallel(schedule="bounded").schedule == "1f1b"
    assert PipelineParallel(schedule="1f1b") == PipelineParallel(schedule="bounded")
