"""The generic trainer on a model with state besides its parameters (``own_bn_model``, defined
in this directory): ``nnx.BatchNorm``'s running statistics, ``nnx.Dropout``'s own RNG stream
and a counter of the user's, carried in the train state (``train.user_state``).

On the 2 x 2 x 2 preset with ZeRO-3 and full remat, the run must match one device within
1e-5 in its losses (the same dropout keys, BatchNorm over the global batch) and in the
statistics it ends with; a run killed after step 2 and resumed from the command line must
reproduce the uninterrupted losses bit for bit (the statistics and RNG counts restored).
"""

import json
import shutil

import jax
import numpy as np
import pytest

import shardlib
from shardlib.tools import cli
from shardlib.train.loop import run

MODULE = "own_bn_model"
SETTINGS = {"steps": 4, "precision": "fp32", "zero": 3, "remat": "full"}


@pytest.fixture(scope="module")
def own():
    import own_bn_model

    return own_bn_model


def _setup(own, mesh=None, **settings):
    cfg = shardlib.user_config("cpu-8-3d", **(SETTINGS | settings))
    return shardlib.make_model_setup(cfg, own.make_model, own.loss_fn, own.batches(), mesh)


def _max_error(a, b) -> float:
    leaves = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in leaves)


@pytest.fixture(scope="module")
def runs(own, tmp_path_factory):
    """One setup on 8 devices: uninterrupted, then killed after step 2 (the checkpoint the
    command line resumes); and the same run on one device."""
    ckpt = tmp_path_factory.mktemp("own_bn") / "ckpt"
    setup = _setup(own, checkpoint_dir=str(ckpt))
    whole = run(setup, show=False)
    trained = setup.trained_model(whole.state)
    shutil.rmtree(ckpt)
    first = run(setup, show=False, stop_after=2)
    mesh = jax.sharding.Mesh(
        np.array(jax.devices()[:1]).reshape(1, 1, 1), ("data", "fsdp", "tensor")
    )
    one = run(_setup(own, mesh=mesh), show=False)
    return whole, first, one, ckpt, trained


@pytest.mark.slow
def test_model_state_trains_and_matches_one_device(runs):
    whole, _, one, _, _ = runs
    err = max(abs(a - b) / abs(b) for a, b in zip(whole.losses, one.losses, strict=True))
    assert err <= 1e-5, (whole.losses, one.losses)
    held, alone = whole.state["model_state"], one.state["model_state"]
    assert _max_error(held["bn"], alone["bn"]) <= 1e-5  # global-batch statistics
    assert float(np.abs(held["bn"]["mean"]).max()) > 0.1  # they moved from their init (zeros)
    assert int(held["calls"]) == 4 and int(held["drop"]["rngs"]["count"]) == 4
    assert _max_error(held["peak"], alone["peak"]) <= 1e-5
    assert held["bn"]["var"].sharding.spec == jax.sharding.PartitionSpec()  # no names
    assert "tensor" in str(held["peak"].sharding.spec)  # ("mlp",): as a parameter's mlp
    assert "model_state" not in whole.records[-1]  # not a metric
    # the optimizer never saw it: Adam's moments cover the parameters only
    assert "bn" in whole.state["params"] and "mean" not in whole.state["params"]["bn"]


@pytest.mark.slow
def test_command_line_resumes_batch_stats_and_dropout_exactly(runs, tmp_path, capsys):
    whole, first, _, ckpt, _ = runs
    jsonl = tmp_path / "metrics.jsonl"
    words = [f"model={MODULE}:make_model", f"loss={MODULE}:loss_fn", f"data={MODULE}:batches"]
    words += [f"{k}={v}" for k, v in SETTINGS.items()]
    words += [f"checkpoint_dir={ckpt}", f"jsonl={jsonl}"]
    code = cli.main(["train", "--mesh", "cpu-8-3d", *words])
    assert code == 0, capsys.readouterr().err
    resumed = [json.loads(line)["loss"] for line in jsonl.read_text().splitlines()]
    assert first.losses + resumed == whole.losses  # bit for bit: same masks, same statistics


@pytest.mark.slow
def test_trained_model_evaluates_on_its_running_statistics(own, runs):
    """``trained_model(state).eval()``: Dropout off, BatchNorm on the running statistics the
    run carried (a one-example batch normalises as the whole batch would)."""
    trained = runs[4]
    trained.eval()
    images = own.batches().source[0]["image"]
    whole = np.asarray(trained(images))
    assert np.array_equal(whole, np.asarray(trained(images)))  # no dropout: deterministic
    np.testing.assert_allclose(np.asarray(trained(images[:1])), whole[:1], rtol=1e-5, atol=1e-6)


def test_dropout_stream_round_trips_through_the_carried_state():
    """Each call folds in a new count (a new mask every step), and the carried state (key as
    uint32 data, count) rebuilds a stream that draws what the original draws next."""
    from flax import nnx

    from shardlib.train import user_state

    drop = nnx.Dropout(0.5, rngs=user_state.seeded_rngs(jax.random.key(0)))
    keys = user_state.read(drop).keys
    x = np.ones((4, 8), np.float32)
    first = drop(x)
    held = user_state.carried(drop, keys)
    assert held["rngs"]["key"].dtype == np.uint32 and int(held["rngs"]["count"]) == 1
    graphdef, params, _ = nnx.split(drop, nnx.Param, ...)
    resumed = nnx.merge(graphdef, params, user_state.as_model_state(held, keys))
    second = drop(x)
    assert not np.array_equal(first, second)
    assert np.array_equal(resumed(x), second)


def test_one_bit_adam_refuses_model_state(own):
    """1-bit Adam's step runs per device in shard_map, where BatchNorm would see a local batch."""
    from shardlib.core.errors import ShardingError

    with pytest.raises(ShardingError, match=r"bn\.mean \(BatchStat\).*optimizer=adamw"):
        _setup(own, optimizer="onebit_adam", zero=0, remat="none")
