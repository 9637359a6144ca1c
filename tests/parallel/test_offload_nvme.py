"""The NVMe tier (``offload.nvme_path``): the optimizer state (and the stacked weights) in
files trains like the in-memory step, moves exactly its own size each way per step (the
weights: read three times, written once), and resumes exactly."""

import shutil

import jax
import numpy as np
import pytest

from shardlib import ShardingError
from shardlib.checkpoint.store import restore
from shardlib.core.mesh import single_device_mesh
from shardlib.parallel.offload_nvme_params import NvmeParams
from shardlib.tools import parity
from shardlib.train.config import override, train_config
from shardlib.train.loop import run
from shardlib.train.nvme import build_nvme_params_step, nvme_state
from shardlib.train.setup import make_setup

CFG = train_config(steps=3, batch=8, seq=16, clip_norm=0.5, **{"model.layers": 2})


def _batches(n):
    return [np.random.default_rng(s).integers(0, 256, (8, 17)).astype(np.int32) for s in range(n)]


@pytest.mark.slow
def test_nvme_state_and_weights_train_like_memory_move_their_size_and_resume_exactly(tmp_path):
    """The optimizer state and the stacked weights in files (``offload_nvme_params``: the
    layer loop reads a layer per trip, forward and backward); the weights held in memory
    take ``NvmeTrainStep`` (``loop.run``'s, the test below)."""
    plain = make_setup(CFG, single_device_mesh())
    setup = make_setup(
        override(CFG, {"offload_optimizer": True, "offload_nvme_path": str(tmp_path / "a")}),
        single_device_mesh(),
    )
    start = parity.random_state(plain)
    params = jax.device_put(start["params"], setup.param_shardings)
    state = nvme_state(setup, params)
    weights = NvmeParams.create(jax.device_get(params["blocks"]), tmp_path / "weights")
    rest_layout = {k: v for k, v in setup.param_shardings.items() if k != "blocks"}
    rest = {k: v for k, v in params.items() if k != "blocks"}
    step, kept = build_nvme_params_step(setup, state, weights), None
    reference = jax.device_put(start, plain.state_shardings)
    for n, batch in enumerate(_batches(3)):
        if n == 2:  # a checkpoint after two steps: the files, the scalars, the parameters
            state.save(tmp_path / "ckpt")
            weights.save(tmp_path / "ckpt")
            kept = jax.device_get(rest)
        state.io.read = state.io.written = weights.io.read = weights.io.written = 0
        rest, metrics = step(rest, batch)
        reference, ref_metrics = plain.train_step(reference, batch)
        assert state.io.read == state.io.written == state.nbytes  # the state, once each way
        # the weights: read forward, backward and by the update; written by the update
        assert (weights.io.read, weights.io.written) == (3 * weights.nbytes, weights.nbytes)
        assert float(metrics["loss"]) == pytest.approx(float(ref_metrics["loss"]), rel=1e-6)

    def trained():
        return {**jax.device_get(rest), "blocks": jax.tree.map(np.array, weights.tree())}

    final = trained()
    want = jax.tree.leaves(reference["params"])
    for got, ref in zip(jax.tree.leaves(final), want, strict=True):
        np.testing.assert_allclose(got, np.asarray(ref), rtol=1e-5, atol=1e-7)

    state.load(tmp_path / "ckpt")  # the files copied back, the scalars read
    weights.load(tmp_path / "ckpt")
    rest, _ = step(jax.device_put(kept, rest_layout), _batches(3)[2])
    for got, ref in zip(jax.tree.leaves(trained()), jax.tree.leaves(final), strict=True):
        np.testing.assert_array_equal(got, ref)  # bit for bit


def test_nvme_tier_refuses_what_it_cannot_hold(monkeypatch):
    with pytest.raises(ShardingError, match="offload_optimizer=true"):
        make_setup(override(CFG, {"offload_nvme_path": "/tmp/x"}), single_device_mesh())
    with pytest.raises(ShardingError, match="drop nvme_params"):  # the weights need a path
        make_setup(override(CFG, {"offload_nvme_params": True}), single_device_mesh())
    setup = make_setup(
        override(CFG, {"offload_optimizer": True, "offload_nvme_path": "/tmp/x"}),
        single_device_mesh(),
    )
    with monkeypatch.context() as patch, pytest.raises(ShardingError, match="one process"):
        patch.setattr(jax, "process_count", lambda: 2)  # what a run on two hosts sees
        setup.train_step  # noqa: B018
    with pytest.raises(ShardingError, match="zero=0"):
        nvme_state(make_setup(override(setup.cfg, {"zero": 1}), single_device_mesh()), {})
    with pytest.raises(ShardingError, match="loss scale"):
        nvme_state(make_setup(override(setup.cfg, {"precision": "fp16"}), single_device_mesh()), {})


@pytest.mark.slow
def test_shardlib_train_runs_the_tier_and_resumes_from_its_checkpoint_exactly(tmp_path):
    """``loop.run`` (what ``shardlib train`` calls) drives the NVMe step; a checkpoint holds
    optax's state (and the weights) read from the files, so a run whose files are gone
    resumes from it bit for bit, and the in-memory offload setup reads the same checkpoint.
    The interrupted run keeps its weights in files too (``offload.nvme_params``): it trains
    bit for bit like the one that holds them in memory."""
    tier = {"offload_optimizer": True, "offload_nvme_path": str(tmp_path / "files")}
    whole = run(make_setup(override(CFG, tier), single_device_mesh()), show=False)
    assert not (tmp_path / "ckpt").exists()
    tier = {**tier, "offload_nvme_params": True, "checkpoint_dir": str(tmp_path / "ckpt")}
    setup = make_setup(override(CFG, tier), single_device_mesh())
    first = run(setup, show=False, stop_after=2)
    assert first.stopped_by and len(first.losses) == 2
    shutil.rmtree(tmp_path / "files")  # only the checkpoint is left to resume from
    second = run(make_setup(override(CFG, tier), single_device_mesh()), show=False)
    assert first.losses + second.losses == whole.losses
    weights = second.state["params"]["blocks"]
    assert isinstance(weights, NvmeParams)
    assert (weights.io.read, weights.io.written) == (3 * weights.nbytes, weights.nbytes)
    for got, want in zip(
        jax.tree.leaves({**second.state["params"], "blocks": weights.tree()}),
        jax.tree.leaves(whole.state["params"]),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    memory = make_setup(override(CFG, {"offload_optimizer": True}), single_device_mesh())
    saved = restore(tmp_path / "ckpt", memory, step=3).state
    files = {"opt_state": second.state["opt_state"].tree(), "blocks": weights.tree()}
    for got, want in zip(
        jax.tree.leaves((saved["opt_state"], saved["params"]["blocks"])),
        jax.tree.leaves((files["opt_state"], files["blocks"])),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
