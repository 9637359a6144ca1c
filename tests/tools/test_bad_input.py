"""Bad input a new user hits on a first model of their own, one test per point.

Each bad input must be a one-line ``ShardingError`` naming the value and a fix (on the
command line: exit code 2, no traceback), raised before any training step.
"""

import io

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console

import shardlib
from shardlib import ShardingError
from shardlib.tools.cli import main


def _one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text, text
    return text


# --- 3. rules_for_mesh takes a Mesh, a MeshSpec or a mapping, and refuses unknown axes -------
def test_rules_for_mesh_takes_a_mesh_a_spec_or_a_mapping():
    mesh = shardlib.mesh_spec(data=2, tensor=4).build()
    from_mesh = shardlib.rules_for_mesh(mesh)
    assert from_mesh == shardlib.rules_for_mesh(shardlib.mesh_spec(data=2, tensor=4))
    assert from_mesh == shardlib.rules_for_mesh({"data": 2, "tensor": 4})
    assert from_mesh.spec(("batch", "mlp")) == P("data", "tensor")
    assert shardlib.rules_for_mesh(shardlib.mesh_spec(fsdp=-1)).spec(("batch",)) == P("fsdp")


def test_rules_for_mesh_refuses_an_unknown_axis():
    with pytest.raises(ShardingError) as err:
        shardlib.rules_for_mesh({"tensr": 8})
    assert "'tensr'" in _one_line(err.value) and "Fix: use one of" in str(err.value)
    with pytest.raises(ShardingError, match="jax.sharding.Mesh, a shardlib.MeshSpec"):
        shardlib.rules_for_mesh(8)


# --- 4. one call adds a logical name to both tables ------------------------------------------
def test_with_name_adds_a_logical_name_to_both_tables():
    rules = shardlib.rules_for_mesh({"tensor": 8}).with_name("classes", activations="tensor")
    assert rules.params["classes"] == () and rules.activations["classes"] == ("tensor",)
    assert rules.spec(("batch", "classes")) == P(None, "tensor")
    with pytest.raises(ShardingError, match="'embed' is already in the params rules"):
        rules.with_name("embed")
    assert set(shardlib.LOGICAL_NAMES) <= set(rules.params)
    for name in shardlib.ParallelPlan.logical_names():  # names strategies add
        assert name in shardlib.rules_for_mesh({"data": 8}).params


def test_the_vocabulary_is_documented():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "logical_names.md").read_text()
    for name in (*shardlib.LOGICAL_NAMES, *shardlib.ParallelPlan.logical_names()):
        assert f"`{name}`" in page, name
    assert "with_name" in page


# --- 6. activation errors name the tensor ------------------------------------------------------
def test_an_activation_error_names_the_line_that_constrained_it():
    mesh = shardlib.mesh_spec(data=8).build()
    rules = shardlib.rules_for_mesh(mesh)

    def forward(x_BD):
        with shardlib.use_layout(mesh, rules):
            return shardlib.constrain(x_BD * 2, ("batch", "embed"))  # the line named

    with pytest.raises(ShardingError) as err:
        jax.jit(forward).lower(jax.ShapeDtypeStruct((3, 4), jnp.float32))
    text = _one_line(err.value)
    assert "activation [batch, embed] at test_bad_input.py:" in text, text
    assert "in test_an_activation_error_names_the_line_that_constrained_it.<locals>.forward" in text
    assert "tensor 'activation'" not in text


# --- 9. show_sharding: one label style, and how a 3-axis mesh is folded ----------------------
def test_tile_labels_use_one_style_and_a_3d_mesh_says_how_it_is_folded():
    mesh = shardlib.mesh_spec(data=2, fsdp=2, tensor=2).build()
    x = jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(shardlib.show_sharding(x))
    out = console.file.getvalue()
    assert "dev 0,1,2,3" in out and "dev 4,5,6,7" in out  # a run is listed like any set
    assert "0-3" not in out
    assert "column = fsdp·2 + tensor" in out
    strided = jax.ShapeDtypeStruct((4, 8), jnp.float32, sharding=NamedSharding(mesh, P("tensor")))
    console = Console(file=io.StringIO(), width=100, color_system=None)
    console.print(shardlib.show_sharding(strided))
    assert "dev 0,2,4,6" in console.file.getvalue()


# --- 8. the command line checks every input before the first step ----------------------------
def _cli_error(capsys, args: list[str]) -> str:
    assert main(args) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert "loss" not in captured.err + captured.out  # no progress line came first
    lines = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, captured.err
    return lines[0]


def test_cli_names_a_negative_step_count(capsys):
    line = _cli_error(capsys, ["train", "--mesh", "cpu-8-dp", "steps=-1"])
    assert "steps=-1" in line and "Fix:" in line


def test_cli_refuses_a_boolean_mesh_size(capsys, tmp_path):
    mesh = tmp_path / "bool.toml"
    mesh.write_text("[mesh]\ndata = true\n")
    line = _cli_error(capsys, ["train", "--mesh", str(mesh), "steps=1"])
    assert "axis 'data' has size True" in line


def test_cli_reports_an_odd_token_file_before_any_progress(capsys, tmp_path):
    tokens = tmp_path / "tokens.bin"
    np.arange(40, dtype=np.uint16).tofile(tokens)
    with tokens.open("ab") as f:
        f.write(b"x")  # 81 bytes: not whole uint16 tokens
    line = _cli_error(capsys, ["train", "--mesh", "cpu-8-dp", f"data={tokens}", "steps=2"])
    assert "81 bytes" in line and "uint16" in line and "Fix:" in line


@pytest.mark.parametrize("lr", ["-1", "0", "nan", "inf"])
def test_cli_refuses_a_learning_rate_that_is_not_positive_and_finite(capsys, lr):
    """lr=-1 once trained on, the loss climbing from 6.6 to 699 in 6 steps, exit 0."""
    line = _cli_error(capsys, ["train", "--mesh", "cpu-8-dp", f"lr={lr}", "steps=1"])
    assert f"optimizer.lr={float(lr)}" in line and "> 0" in line and "Fix: " in line


def test_cli_refuses_a_training_seq_longer_than_the_models_positions(capsys):
    words = ["seq=64", "model.max_positions=32", "batch=8", "steps=1"]
    line = _cli_error(capsys, ["train", "--mesh", "cpu-8-dp", *words])
    assert "dataset.seq=64" in line and "max_positions=32" in line
    assert "Fix: seq=32 or less" in line and "model.max_positions=64" in line


def test_cli_names_a_mesh_that_is_a_directory(capsys, tmp_path):
    (tmp_path / "mine.toml").write_text("[mesh]\ndata = 8\n")
    line = _cli_error(capsys, ["train", "--mesh", str(tmp_path), "steps=1"])
    assert f"mesh {str(tmp_path)!r} is a directory" in line
    assert f"--mesh {tmp_path / 'mine.toml'}" in line and "cpu-8-dp" in line  # the fix


# --- 1, 2. a one-device build, and the optimizer's scalars on the whole mesh ------------------
class _Annotated(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.with_partitioning(nnx.initializers.normal(0.1), ("embed", "mlp"))
        self.up = nnx.Linear(8, 16, kernel_init=init, rngs=rngs)  # kernel [embed, mlp]

    def __call__(self, x_BD):
        return shardlib.constrain(self.up(x_BD), ("batch", "mlp"))


def test_build_model_on_one_device_and_on_a_mesh():
    model = shardlib.build_model(lambda: _Annotated(nnx.Rngs(0)))  # no mesh, no error
    kernel = model.up.kernel[...]
    assert len(kernel.sharding.device_set) == 1
    mesh = shardlib.mesh_spec(tensor=8).build()
    sharded = shardlib.build_model(lambda: _Annotated(nnx.Rngs(0)), mesh)  # rules_for_mesh
    assert sharded.up.kernel[...].sharding.spec == P(None, "tensor")
    np.testing.assert_array_equal(np.asarray(sharded.up.kernel[...]), np.asarray(kernel))
    one = shardlib.reference_mesh(mesh)
    assert one.axis_names == ("tensor",) and one.devices.size == 1


def test_optimizer_scalars_are_replicated_over_the_mesh():
    mesh = shardlib.mesh_spec(fsdp=8).build()
    rules = shardlib.rules_for_mesh(mesh)
    _, params = shardlib.abstract_params(lambda: _Annotated(nnx.Rngs(0)), mesh, rules)
    params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), params)
    opt = shardlib.init_optimizer(optax.adam(1e-3), params)
    assert opt[0].count.sharding.device_set == set(mesh.devices.flat)  # not device 0 alone
    assert opt[0].mu["up"]["kernel"].sharding == params["up"]["kernel"].sharding
    batch = shardlib.batch_sharding(mesh, rules, ("batch", None), shape=(16, 8))
    assert batch.spec == P("fsdp")
    with pytest.raises(ShardingError) as err:
        shardlib.batch_sharding(mesh, rules, ("batch", None), shape=(3, 8))
    assert "'batch'" in _one_line(err.value) and "size 3" in str(err.value)


# --- 5. explain finds the parameters from its arguments, not from a substring -----------------
def test_explain_takes_params_and_warns_when_it_has_to_guess():
    mesh = shardlib.mesh_spec(data=8).build()
    spec = NamedSharding(mesh, P())
    weights = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=spec)}
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=NamedSharding(mesh, P("data")))

    def forward(weights, x):
        return (x @ weights["w"]).sum()

    guessed = shardlib.explain(forward, weights, x)
    assert guessed.params_count == 32 + 64 and "params=" in guessed.warnings[-1]
    given = shardlib.explain(forward, weights, x, params=weights)
    assert given.params_count == 32 and not given.warnings
    assert shardlib.explain(forward, weights, x, params="weights").params_count == 32
    with pytest.raises(ShardingError, match="params='wieghts' matches no input path"):
        shardlib.explain(forward, weights, x, params="wieghts")


# --- 2. notebook 01 uses only top-level names --------------------------------------------------
def test_notebook_01_uses_only_public_names():
    import json
    import re
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "notebooks" / "01_annotate_a_flax_model.ipynb"
    cells = json.loads(path.read_text())["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    assert not re.findall(r"(?:from|import) shardlib\.\w+", code)  # no submodule imports
    used = set(re.findall(r"\bshardlib\.(\w+)", code))
    for names in re.findall(r"from shardlib import ([\w, ]+)", code):
        used |= {n.strip() for n in names.split(",")}
    assert used and used <= set(shardlib.__all__), used - set(shardlib.__all__)


def test_a_collective_is_traced_to_the_input_it_moves_and_to_user_code():
    from shardlib.analysis import attribute, hlo

    text = """HloModule m, num_partitions=8

ENTRY %main (p: f32[2,32]) -> f32[16,32] {
  %param = f32[2,32]{1,0} parameter(0), metadata={op_name="state[\\'params\\'][\\'w\\']"}
  %copy = f32[2,32]{1,0} copy(%param)
  ROOT %all-gather = f32[16,32]{1,0} all-gather(%copy), replica_groups=[1,8]<=[8], GATHER
}

FileNames
1 "/home/me/train.py"
2 "/venv/lib/python3.12/site-packages/flax/nnx/nn/linear.py"

FunctionNames
1 "Model.__call__"
2 "Linear.__call__"

FileLocations
1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=4 end_column=4}
2 {file_name_id=1 function_name_id=1 line=12 end_line=12 column=4 end_column=4}
3 {file_name_id=2 function_name_id=2 line=431 end_line=431 column=8 end_column=8}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}
3 {file_location_id=3 parent_frame_id=3}
"""
    text = text.replace("GATHER", 'dimensions={0}, metadata={op_name="f" stack_frame_id=3}')
    module = hlo.parse_module(text)
    assert attribute.moved_input(module, "main", "all-gather") == "state.params.w"
    frames = attribute.stack_frames(text)  # frame 3 (flax) is called from frame 2 (train.py)
    assert frames[3] == "train.py:12 in Model.__call__"
    inst = module.computations["main"].instructions[-1]
    assert attribute.source(inst.attrs, frames) == "train.py:12 in Model.__call__"
