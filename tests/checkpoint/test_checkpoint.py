"""Checkpoints in one process: bitwise resume, retention, restore onto other meshes, export,
bad input (missing, damaged, another model: a clear error and nothing on disk touched),
and the signal handling behind preemption."""

import gc
import io
import json
import re
import shutil
import signal
import struct
from pathlib import Path

import jax
import numpy as np
import pytest
from checkpoint_damage import DAMAGE, WHAT, snapshot
from rich.console import Console
from tiny_runs import CUBE, ONE, cube_runs, setup

from shardlib.checkpoint.store import TMP_MARK, CheckpointError, restore, tensor_names
from shardlib.core.errors import ShardingError
from shardlib.distributed.preempt import Preemption
from shardlib.interop.export import read_params
from shardlib.tools.cli import main
from shardlib.train.loop import run

pytestmark = pytest.mark.slow  # compiles and trains: the full suite, not the inner loop


def test_resume_after_stop_is_bitwise_and_old_checkpoints_are_dropped():
    r = cube_runs()
    assert len(r.stopped) == 3 and r.resumed_first_step == 4
    assert r.stopped + r.resumed == r.uninterrupted  # exact float equality, all 40 steps
    assert r.fingerprints_match  # and the final states are bit-for-bit the same
    assert r.steps_kept == [30, 40]  # saved at 3 (stop), 10, 20, 30, 40; keep=2


RESHARD_TARGETS = {
    "fsdp4": (("fsdp", 4),),
    "tensor8": (("tensor", 8),),
    "one-device": ONE,
    "fsdp2xtensor4": (("fsdp", 2), ("tensor", 4)),
}


@pytest.mark.parametrize("target", RESHARD_TARGETS)
def test_restore_onto_another_mesh(target):
    """Saved on data x fsdp x tensor = 2x2x2, read straight into the target's shards."""
    r = cube_runs()
    s = setup(RESHARD_TARGETS[target])
    restored = restore(r.directory, s, step=30)
    assert restored.meta["mesh"]["axes"] == dict(CUBE)
    leaves = jax.tree.leaves(restored.state)
    for x, sharding in zip(leaves, jax.tree.leaves(s.state_shardings), strict=True):
        assert x.sharding.is_equivalent_to(sharding, x.ndim)
        for shard in x.addressable_shards:  # each device holds its shard, never more
            assert shard.data.shape == sharding.shard_shape(x.shape)
    _, saved, _ = read_params(r.directory, 30)  # as saved, read without any mesh
    params = restored.state["params"]
    for name, x in zip(tensor_names(params), jax.tree.leaves(params), strict=True):
        assert np.array_equal(np.asarray(x), saved[name]), name
    continued = run(s, state=restored.state, show=False).losses  # steps 31..40
    reference = np.array(r.uninterrupted[30:])
    assert len(continued) == 10
    error = np.max(np.abs(np.array(continued) - reference) / reference)
    print(f"\n2x2x2 -> {target}: values bitwise equal, next 10 losses max rel. error {error:.1e}")
    assert error <= 1e-5


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A reader written from the format description: no shardlib, no safetensors package."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__")
    dtypes = {"F32": np.float32, "BF16": None, "I32": np.int32}
    out = {}
    for name, info in header.items():
        a, b = info["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a : 8 + n + b], dtypes[info["dtype"]])
        out[name] = out[name].reshape(info["shape"])
    return out


def test_export_takes_a_relative_checkpoint_path(tmp_path, monkeypatch):
    """The README's ``shardlib export --checkpoint ckpt``: orbax itself wants absolute paths."""
    r = cube_runs()
    monkeypatch.chdir(r.directory.parent)
    assert main(["export", "--checkpoint", r.directory.name, "--out", str(tmp_path / "p.npz")]) == 0
    assert dict(np.load(tmp_path / "p.npz")).keys() == r.final_params.keys()


def test_export_is_readable_without_shardlib(tmp_path):
    import orbax.checkpoint as ocp

    r = cube_runs()
    for out in ("params.safetensors", "params.npz", "plain"):
        assert main(["export", "--checkpoint", str(r.directory), "--out", str(tmp_path / out)]) == 0
    loaded = {
        "safetensors": _load_safetensors(tmp_path / "params.safetensors"),
        "npz": dict(np.load(tmp_path / "params.npz")),
    }
    tree = ocp.StandardCheckpointer().restore((tmp_path / "plain" / "params").absolute())
    loaded["orbax"] = dict(zip(tensor_names(tree), jax.tree.leaves(tree), strict=True))
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert config["step"] == 40 and config["model"]["layers"] == 1
    for fmt, tensors in loaded.items():
        assert tensors.keys() == r.final_params.keys(), fmt
        for name, x in tensors.items():
            assert np.array_equal(np.asarray(x), r.final_params[name]), (fmt, name)


# --- bad input ----------------------------------------------------------------------------


def _copy_of_cube_checkpoints(tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(cube_runs().directory, copy)
    return copy


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_newest_checkpoint_falls_back_and_is_left_alone(tmp_path, damage):
    """Step 40 damaged, 30 complete: the run resumes from 30 with one line naming what is
    damaged and the step skipped, and trains to 40 without writing over the damaged step.
    With no older step the damage is refused. Neither changes anything on disk."""
    directory = _copy_of_cube_checkpoints(tmp_path)
    DAMAGE[damage](directory / "40")
    before = snapshot(directory)
    out = io.StringIO()
    result = run(setup(ONE, str(directory)), show=False, console=Console(file=out, width=1000))
    gc.collect()  # orbax leaves the other arrays' reads pending when one fails: drop them here
    skipped = rf"skipped step 40 \(persistent, {re.escape(str(directory / '40'))}\): "
    line = skipped + WHAT[damage] + " is damaged; falling back to step 30 "
    assert re.search(line, out.getvalue()), out.getvalue()
    assert [r["step"] for r in result.records] == list(range(31, 41))
    assert snapshot(directory) == before  # 40 is not written over; every=10 saves nothing else
    shutil.rmtree(directory / "30")
    before = snapshot(directory)
    with pytest.raises(CheckpointError, match=r"40 is damaged.*Fix: restore an earlier step"):
        run(setup(ONE, str(directory)), show=False)  # nothing older to fall back to
    gc.collect()
    assert snapshot(directory) == before


def test_checkpoint_of_another_model_names_the_tensor(tmp_path):
    directory = _copy_of_cube_checkpoints(tmp_path)
    before = snapshot(directory)
    from shardlib.train.config import override
    from shardlib.train.setup import make_setup

    base = setup(ONE, str(directory))
    other = make_setup(override(base.cfg, {"model.layers": 2}), base.mesh)
    with pytest.raises(CheckpointError, match=r"another model: params/blocks/.*layers=1 \(this"):
        run(other, show=False)
    wider = make_setup(override(base.cfg, {"model.layers": 1, "model.vocab": 512}), base.mesh)
    with pytest.raises(CheckpointError, match=r"params/embedding: checkpoint float32\[256, 64\]"):
        restore(directory, wider)
    assert snapshot(directory) == before


def test_missing_or_empty_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        restore(tmp_path / "nowhere", setup(ONE))
    (tmp_path / "empty" / f"7{TMP_MARK}").mkdir(parents=True)  # an unfinished save only
    with pytest.raises(CheckpointError, match="no complete checkpoint.*unfinished saves"):
        restore(tmp_path / "empty", setup(ONE))
    # resume=never refuses a directory that holds checkpoints (it would overwrite them)
    from shardlib.train.config import override
    from shardlib.train.setup import make_setup

    directory = _copy_of_cube_checkpoints(tmp_path)
    never_cfg = override(setup(ONE, str(directory)).cfg, {"resume": "never"})
    never = make_setup(never_cfg, setup(ONE).mesh)
    with pytest.raises(ShardingError, match="already holds checkpoints"):
        run(never, show=False)


def test_a_resume_that_would_move_the_schedule_is_refused_and_schedule_steps_keeps_it(tmp_path):
    """The cube run saved at step 30 of 40 (warmup_cosine): resuming with steps=50 would
    decay over 50 steps instead, so it is refused before anything is written; with
    schedule_steps=40 the resumed run follows the uninterrupted run exactly, then trains on
    at the final rate. A shorter run that ends where it is resumed changes nothing."""
    from shardlib.train.config import override
    from shardlib.train.setup import make_setup

    directory = _copy_of_cube_checkpoints(tmp_path)
    shutil.rmtree(directory / "40")  # resume from step 30
    base = setup(CUBE, str(directory))
    longer = make_setup(override(base.cfg, {"steps": 50}), base.mesh)
    before = snapshot(directory)
    with pytest.raises(ShardingError, match=r"run.steps 40 -> 50 changes the learning-rate "
                       r"schedule .*lr at step 30 .*Fix: schedule_steps=40"):  # fmt: skip
        run(longer, show=False)
    assert snapshot(directory) == before
    kept = make_setup(override(base.cfg, {"steps": 50, "schedule_steps": 40}), base.mesh)
    losses = run(kept, show=False, stop_after=40).losses
    assert list(losses) == list(cube_runs().uninterrupted[30:40])


def test_an_unfinished_save_is_ignored(tmp_path):
    directory = _copy_of_cube_checkpoints(tmp_path)
    shutil.copytree(directory / "40", directory / f"50{TMP_MARK}")  # looks like a crash
    assert restore(directory, setup(ONE)).step == 40


def test_a_signal_becomes_a_stop_request_and_a_second_one_interrupts():
    # Python's own Ctrl-C handler before the run, whatever earlier tests in this worker
    # process left installed (the second signal gets the handler the run found)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with Preemption() as preempt:
            assert not preempt.should_stop(1)
            signal.raise_signal(signal.SIGINT)
            assert preempt.should_stop(2) and preempt.reason == "SIGINT"
            with pytest.raises(KeyboardInterrupt):  # Ctrl-C twice: the usual interrupt
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
