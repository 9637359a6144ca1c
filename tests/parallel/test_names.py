"""The model's own logical names (``shardlib.parallel.names``) from the command line and a
mesh file, and the error that names the fix when one is missing.

``FfnDecoder`` names its MLP's hidden dim ``ffn``, a name shardlib does not know: without a
rule for it the run is refused before compiling, with ``rules.ffn=...`` as the fix; with
``rules.ffn=tensor`` (or ``[rules] ffn = ["tensor"]``) its MLP weights split over tensor.
"""

import json

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardlib import ShardingError, mesh_spec
from shardlib.core.layout import constrain
from shardlib.core.mesh import load_mesh
from shardlib.core.resolve import resolve_spec
from shardlib.parallel.plan import ParallelPlan
from shardlib.tools.cli import main
from shardlib.train.config import TrainConfig, parse_overrides, train_config

FACTORY = f"{__name__}:make_model"
WORDS = [f"model={FACTORY}", "batch=8", "seq=16", "steps=1"]


def _param(rngs, shape, names, fan_in):
    init = nnx.with_partitioning(nnx.initializers.normal(fan_in**-0.5), names)
    return nnx.Param(init(rngs.params(), shape, jnp.float32))


class FfnBlock(nnx.Module):
    """A residual MLP whose hidden dim is the model's own ``ffn``."""

    def __init__(self, embed: int, ffn: int, rngs: nnx.Rngs):
        self.w_in = _param(rngs, (embed, ffn), ("embed", "ffn"), embed)  # [embed, ffn]
        self.w_out = _param(rngs, (ffn, embed), ("ffn", "embed"), ffn)  # [ffn, embed]

    def __call__(self, x_BLD, positions_L=None):
        h_BLF = jax.nn.gelu(x_BLD @ self.w_in[...].astype(x_BLD.dtype))
        h_BLF = constrain(h_BLF, ("batch", "seq", "ffn"))
        return constrain(
            x_BLD + h_BLF @ self.w_out[...].astype(x_BLD.dtype), ("batch", "seq", "embed")
        )


class FfnDecoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, *, vocab: int = 256, embed: int = 32, ffn: int = 64):
        self.table = _param(rngs, (vocab, embed), ("vocab", "embed"), 1)  # [vocab, embed]

        @nnx.split_rngs(splits=2)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(rngs: nnx.Rngs) -> FfnBlock:
            return FfnBlock(embed, ffn, rngs)

        self.blocks = stack(rngs)  # every weight [layers, ...]
        self.out = _param(rngs, (embed, vocab), ("embed", "vocab"), embed)  # [embed, vocab]

    def embed(self, tokens_BL, *, dtype=jnp.float32):
        x_BLD = jnp.take(self.table[...], tokens_BL, axis=0).astype(dtype)
        return constrain(x_BLD, ("batch", "seq", "embed"))

    def head(self, x_BLD, *, dtype=jnp.float32):
        logits_BLV = jnp.einsum("bld,dv->blv", x_BLD, self.out[...].astype(dtype))
        return constrain(logits_BLV.astype(jnp.float32), ("batch", "seq", "vocab"))


def make_model(rngs: nnx.Rngs) -> FfnDecoder:
    return FfnDecoder(rngs)


def _plan(**axes) -> TrainConfig:
    return TrainConfig(parallel=ParallelPlan(mesh=mesh_spec(**axes)))


def test_rules_setting_adds_a_model_name_to_both_tables():
    words = ["rules.ffn=tensor", "rules.patches=", "rules.pair=data,tensor"]
    rules = parse_overrides(words, _plan(data=2, tensor=4)).parallel.rules
    assert rules.params["ffn"] == rules.activations["ffn"] == ("tensor",)
    assert rules.params["patches"] == rules.activations["patches"] == ()
    assert rules.params["pair"] == ("data", "tensor")
    assert rules.spec(("batch", "seq", "ffn")) == P("data", None, "tensor")
    again = parse_overrides(["rules.ffn=none"], parse_overrides(words, _plan(data=2, tensor=4)))
    assert again.parallel.rules.params["ffn"] == ()  # a name given again takes the new axes
    python = train_config(rules__ffn="tensor").parallel.custom_names
    assert python == (("ffn", ("tensor",)),)


def test_a_mesh_file_rules_table_adds_model_names(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text('[mesh]\nfsdp = 2\ntensor = 4\n\n[rules]\nffn = ["tensor"]\npatches = []\n')
    plan = ParallelPlan.from_mesh_spec(load_mesh(path))
    assert plan.rules.params["ffn"] == plan.rules.activations["ffn"] == ("tensor",)
    assert plan.rules.params["patches"] == ()
    assert "rules.ffn=tensor" in plan.describe()
    settings = parse_overrides(["rules.ffn=fsdp"], TrainConfig(parallel=plan))
    assert settings.parallel.rules.params["ffn"] == ("fsdp",)  # the command line wins


def test_rules_refuses_shardlib_names_missing_axes_and_odd_values(tmp_path):
    with pytest.raises(ShardingError, match="'embed' is one of shardlib's logical names"):
        _ = parse_overrides(["rules.embed=tensor"], _plan(tensor=8)).parallel.rules
    with pytest.raises(ShardingError, match="names mesh axis 'tensr'.*Fix: add 'tensr'"):
        _ = parse_overrides(["rules.ffn=tensr"], _plan(tensor=8)).parallel.rules
    with pytest.raises(ShardingError, match="rules.NAME takes one logical name"):
        parse_overrides(["rules.ffn.params=tensor"], _plan(tensor=8))
    path = tmp_path / "odd.toml"
    path.write_text("[mesh]\ntensor = 8\n\n[rules]\nffn = 4\n")
    with pytest.raises(ShardingError, match=r"rules.ffn=4: expected mesh axes. Fix: rules.ffn"):
        ParallelPlan.from_mesh_spec(load_mesh(path))
    path.write_text('rules = "tensor"\n\n[mesh]\ntensor = 8\n')
    with pytest.raises(ShardingError, match=r"is not a table. Fix: \[rules\] NAME = "):
        ParallelPlan.from_mesh_spec(load_mesh(path))


def test_an_unknown_name_error_names_with_name_and_the_settings():
    rules = ParallelPlan(mesh=mesh_spec(tensor=8)).rules
    with pytest.raises(ShardingError) as err:
        resolve_spec("blocks.w_in", (2, 32, 64), ("layers", "embed", "ffn"), rules, {"tensor": 8})
    text = str(err.value)
    assert "\n" not in text and "'blocks.w_in' dim 2 is annotated 'ffn'" in text
    assert "rules.with_name('ffn')" in text and "rules.ffn=AXIS" in text
    assert "[rules] ffn = " in text and "replace" not in text  # replace fixed one table only


def _cli(capsys, args):
    code = main(args)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return code, captured.err


def test_cli_refuses_a_model_name_without_a_rule_then_lays_it_out(capsys, tmp_path):
    code, err = _cli(capsys, ["explain", "--mesh", "cpu-8-tp", *WORDS])
    assert code == 2, err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert "annotated 'ffn'" in line and "rules.ffn=AXIS" in line and "with_name" in line
    out = tmp_path / "layout.json"
    code, err = _cli(
        capsys, ["explain", "--mesh", "cpu-8-tp", *WORDS, "rules.ffn=tensor", "--json", str(out)]
    )
    assert code == 0, err
    specs = {t["path"]: t["spec"] for t in json.loads(out.read_text())["tensors"]}
    assert specs["state.params.blocks.w_in"] == "P(None, None, 'tensor')", specs


def test_cli_reads_the_rules_table_of_a_mesh_file(capsys, tmp_path):
    mesh = tmp_path / "mine.toml"
    mesh.write_text(
        'platform = "cpu"\n\n[mesh]\ndata = 2\ntensor = 4\n\n[rules]\nffn = ["tensor"]\n'
    )
    out = tmp_path / "layout.json"
    code, err = _cli(capsys, ["explain", "--mesh", str(mesh), *WORDS, "--json", str(out)])
    assert code == 0, err
    specs = {t["path"]: t["spec"] for t in json.loads(out.read_text())["tensors"]}
    assert specs["state.params.blocks.w_out"] == "P(None, 'tensor')", specs


def test_deepspeed_config_keeps_the_mesh_files_rules(tmp_path):
    """``--deepspeed`` replaces the mesh file's layout, not the model's own names."""
    from shardlib.tools.deepspeed_cli import deepspeed_base

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1}))
    mesh = tmp_path / "mine.toml"
    mesh.write_text('[mesh]\ndata = -1\n\n[rules]\nffn = ["data"]\n')
    spec = load_mesh(mesh)
    cfg = deepspeed_base(str(ds), 8, spec.platform, spec.rules)
    assert cfg.parallel.custom_names == (("ffn", ("data",)),)
    assert cfg.parallel.with_devices(8).rules.params["ffn"] == ("data",)
