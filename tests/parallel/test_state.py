"""Optimizer-state layouts: one rule (``parallel.state.opt_state_specs``) for the trainer and
for a loop of one's own (``shardlib.optimizer_shardings``). Nothing here compiles."""

import jax
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardlib
from shardlib import ShardingError, mesh_spec
from shardlib.parallel.state import opt_state_specs
from shardlib.train.config import override, train_config
from shardlib.train.setup import make_setup

# With factored_min_dim=32 adafactor factors llama-tiny's [embed=64, mlp=256] weights.
CFG = train_config(batch=16, seq=16, factored_min_dim=32, optimizer="adafactor")


@pytest.fixture(scope="module")
def fsdp_setup():
    return make_setup(override(CFG, {"model.layers": 1}), mesh_spec(fsdp=8).build())


def placed_params(setup):
    """The parameters as a loop of one's own holds them: shapes with their shardings."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        setup.param_shapes,
        setup.param_shardings,
    )


def factored(tree):
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "v_row"))
    return next(x for x in leaves if hasattr(x, "v_row"))


def test_public_api_and_trainer_lay_out_adafactor_alike(fsdp_setup):
    """Given the trainer's names and optimizer-state rules, the public function is the
    trainer's layout, leaf for leaf (factored statistics included)."""
    setup = fsdp_setup
    public = shardlib.optimizer_shardings(
        setup.tx,
        placed_params(setup),
        rules=setup.plan.state_rules.opt_state,
        names=setup.param_names,
    )
    assert jax.tree.structure(public) == jax.tree.structure(setup.opt_state_shardings)
    for got, want in zip(
        jax.tree.leaves(public), jax.tree.leaves(setup.opt_state_shardings), strict=True
    ):
        assert got == want
    assert factored(public).v_row["embedding"].spec == P("fsdp")  # [embed] keeps its split


def test_factored_statistics_keep_their_parameters_splits_without_rules(fsdp_setup):
    """From the parameters' shardings alone, a factored statistic keeps the splits of the dims
    it keeps (it was replicated once), as the trainer's does."""
    setup = fsdp_setup
    public = factored(shardlib.optimizer_shardings(setup.tx, placed_params(setup)))
    trainer = factored(setup.opt_state_shardings)
    w_up = lambda tree: tree["blocks"]["mlp"]["w_up"]  # noqa: E731  [layers, embed, mlp]
    assert setup.param_shardings["blocks"]["mlp"]["w_up"].spec == P(None, "fsdp")
    assert w_up(public.v_row).spec == w_up(trainer.v_row).spec == P(None, "fsdp")
    assert public.v_row["embedding"].spec == trainer.v_row["embedding"].spec == P("fsdp")
    # v_col [layers, mlp] drops the split dim: replicated here; the trainer's rules let FSDP
    # split mlp instead (rules.SHARED_ORDER), which needs the names
    assert w_up(public.v_col).spec == P()
    assert all(isinstance(s, NamedSharding) for s in jax.tree.leaves(public))


def test_rules_and_names_go_together(fsdp_setup):
    setup = fsdp_setup
    tx = optax.adam(1e-3)
    abstract = jax.eval_shape(tx.init, setup.param_shapes)
    with pytest.raises(ShardingError, match="rules and names go together"):
        opt_state_specs(tx, abstract, setup.param_shapes, setup.mesh, setup.rules)
