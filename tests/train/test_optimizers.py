"""Optimizers and schedules by name: each trains like its one-device run with its state laid
out like its parameters (adafactor's factored statistics keep their parameter's splits)."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from shardlib import ShardingError, mesh_spec
from shardlib.tools import parity
from shardlib.train.config import override, train_config
from shardlib.train.optim import OPTIMIZERS, schedule
from shardlib.train.setup import make_setup

pytestmark = pytest.mark.slow  # compiles and trains: the full suite, not the inner loop

# The config of tests/parallel/test_zero.py (one shared one-device reference for adamw); with
# factored_min_dim=32 adafactor factors llama-tiny's [embed=64, mlp=256] weights.
CFG = train_config(steps=5, batch=16, seq=16, factored_min_dim=32, **{"model.layers": 1})
MESH = {"data": 2, "fsdp": 4}  # parameters split over fsdp, batch over data x fsdp


# adamw (the default) on this mesh is tests/parallel/test_zero.py's hsdp2x4 case; onebit_adam
# and onebit_lamb run on plain data parallelism only (tests/parallel/test_compression.py,
# tests/train/test_onebit_lamb.py).
ELSEWHERE = ("adamw", "onebit_adam", "onebit_lamb")


@pytest.mark.parametrize("name", [n for n in OPTIMIZERS if n not in ELSEWHERE])
def test_optimizer_parity(name):
    cfg = override(CFG, {"optimizer": name})
    setup = make_setup(cfg, mesh_spec(**MESH).build())
    got = parity.trace(setup, parity.random_state(setup), grads=False, params=True)
    result = parity.compare_traces(got, parity.one_device(cfg))
    assert result.ok(), result


def _factored(tree):
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "v_row"))
    return next(x for x in leaves if hasattr(x, "v_row"))


def test_adafactor_factored_statistics_keep_their_splits():
    setup = make_setup(override(CFG, {"optimizer": "adafactor"}), mesh_spec(**MESH).build())
    shapes, shardings = _factored(setup._abstract_opt_state), _factored(setup.opt_state_shardings)
    w_up = lambda tree: tree["blocks"]["mlp"]["w_up"]  # noqa: E731  [layers, embed, mlp]
    assert setup.param_shardings["blocks"]["mlp"]["w_up"].spec == P(None, "fsdp")
    # v_row drops the largest dim (mlp) and keeps embed's split; v_col drops embed, and
    # FSDP's fallback order (rules.SHARED_ORDER) splits it on mlp instead of replicating it
    assert w_up(shapes.v_row).shape == (1, 64) and w_up(shardings.v_row).spec == P(None, "fsdp")
    assert w_up(shapes.v_col).shape == (1, 256)
    assert w_up(shardings.v_col).spec == P(None, "fsdp")
    # embedding [vocab, embed]: v_row [embed] stays split over fsdp
    assert shapes.v_row["embedding"].shape == (64,)
    assert shardings.v_row["embedding"].spec == P("fsdp")


@pytest.mark.parametrize("name", ["constant", "warmup_cosine", "warmup_linear", "inverse_sqrt"])
def test_schedules(name):
    cfg = train_config(steps=20, warmup=4, lr=1.0, min_lr_ratio=0.1, schedule=name)
    lr = [float(schedule(cfg.optimizer, cfg.run.steps)(i)) for i in range(20)]
    if name == "constant":
        assert lr == [1.0] * 20
        return
    assert lr[0] == 0.0 and np.isclose(lr[4], 1.0) and np.isclose(lr[2], 0.5)
    if name == "inverse_sqrt":
        assert np.isclose(lr[16], (4 / 16) ** 0.5)
    else:
        assert lr[19] < lr[10] < lr[5] and lr[19] >= 0.1 - 1e-6


def test_bad_names_are_clear_errors():
    with pytest.raises(ShardingError, match="optimizer='adamax'.*adafactor"):
        train_config(optimizer="adamax")
    with pytest.raises(ShardingError, match="schedule='cosine'"):
        train_config(schedule="cosine")
