"""Runs you can watch: metrics writers, MFU, profiler window, compilation cache, GPU flags."""

import os
import subprocess
import sys

import jax
import pytest

from shardlib.core.errors import ShardingError
from shardlib.core.mesh import single_device_mesh
from shardlib.tools.cli import main
from shardlib.train.config import train_config
from shardlib.train.goodput import Goodput
from shardlib.train.loop import run
from shardlib.train.profiling import CPU_MULTI_DEVICE, compile_cache
from shardlib.train.setup import make_setup
from shardlib.train.xla_flags import GPU_FLAGS, with_gpu_flags

TINY = dict(model__layers=1, batch=8, seq=16, steps=3)


def _setup(tmp_path, **settings):
    settings = {"compile_cache": str(tmp_path / "cache"), **TINY, **settings}
    return make_setup(train_config(**settings))


@pytest.mark.slow
def test_tensorboard_files_read_back_with_tensorboards_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = tmp_path / "tb"
    result = run(_setup(tmp_path, metrics__tensorboard=str(board)), show=False)
    events = EventAccumulator(str(board))
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"train/loss", "train/mfu", "train/lr", "train/grad_norm", "train/goodput"} <= scalars
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [e.value for e in loss] == pytest.approx(result.losses, rel=1e-6)
    # MFU against a stated peak: on CPU, a measured one shared by the simulated devices
    assert "cpu: measured" in result.peak_source and result.peak_flops > 0
    assert all(0 < r["mfu"] <= r["hfu"] for r in result.records)
    assert all(r["memory_step_bytes"] > 0 for r in result.records)


@pytest.mark.slow
def test_wandb_logs_every_step_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # an optional extra (CI installs it; a GPU image may not)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    directory = tmp_path / "wandb"
    settings = dict(metrics__wandb="shardlib-test", metrics__wandb_dir=str(directory))
    run(_setup(tmp_path, **settings), show=False)
    (log,) = directory.glob("wandb/offline-run-*/run-*.wandb")
    data = log.read_bytes()  # the run's protobuf records: the metric names are in them
    assert b"loss" in data and b"mfu" in data and b"goodput" in data


@pytest.mark.slow
def test_a_profile_of_steps_5_to_7_is_written_and_loads(tmp_path):
    profiles = tmp_path / "prof"
    run(_setup(tmp_path, steps=7, profile_steps="5:7", profile_dir=str(profiles)), show=False)
    traces = list(profiles.glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1
    planes = [p.name for p in jax.profiler.ProfileData.from_file(str(traces[0])).planes]
    assert any("CPU" in name for name in planes), planes


JAX_CACHE = ("jax_enable_compilation_cache", "jax_compilation_cache_dir")


@pytest.mark.slow
def test_the_compiled_step_is_stored_in_the_cache_and_jax_is_left_as_it_was(tmp_path):
    before = {name: getattr(jax.config, name) for name in JAX_CACHE}
    cfg = train_config(compile_cache=str(tmp_path / "cache"), **{**TINY, "steps": 1})
    run(make_setup(cfg, single_device_mesh()), show=False)
    assert any((tmp_path / "cache").iterdir())
    # scoped to the step's compile: later programs in this process do not use the cache
    assert {name: getattr(jax.config, name) for name in JAX_CACHE} == before


def test_the_cache_is_off_on_a_multi_device_cpu_mesh_and_the_run_says_why(tmp_path):
    """Executables loaded from JAX's cache can deadlock in XLA's in-process CPU collectives
    (a restarted 2 x 2 x 2 GPipe step aborted after 40 s in rendezvous.cc)."""
    devices = jax.devices()[:2]
    assert compile_cache(str(tmp_path / "cache"), devices) == (None, CPU_MULTI_DEVICE)
    assert compile_cache("auto", devices) == (None, CPU_MULTI_DEVICE)
    assert compile_cache("off", devices) == (None, "")
    assert compile_cache(str(tmp_path / "one"), devices[:1]) == (tmp_path / "one", "")


@pytest.mark.parametrize(
    "settings, needle",
    [
        ({"profile_steps": "2:9"}, "ends after the last step (3)"),
        ({"profile_steps": "1:2"}, "2 <= START <= END"),
        ({"profile_steps": "five"}, "is not START:END"),
        ({"metrics__tensorboard": "FILE/tb"}, "metrics.tensorboard"),
        ({"metrics__jsonl": "FILE/m.jsonl"}, "metrics.jsonl's directory"),
        ({"compile_cache": "FILE/cache"}, "run.compile_cache"),
    ],
)
def test_bad_observability_settings_fail_before_the_first_step(tmp_path, settings, needle):
    blocker = tmp_path / "FILE"
    blocker.write_text("a file where a directory should be")
    settings = {k: v.replace("FILE", str(blocker)) for k, v in settings.items()}
    setup = _setup(tmp_path, **settings)
    with pytest.raises(ShardingError, match="Fix") as err:
        run(setup, show=False)
    assert needle in str(err.value)
    assert not (tmp_path / "cache").exists() or "compile_cache" not in settings


def test_an_unknown_metrics_writer_names_the_known_ones(capsys):
    assert main(["train", "--mesh", "cpu-8-dp", "metrics.mlflow=runs/x"]) == 2
    err = capsys.readouterr().err
    assert "metrics has jsonl," in " ".join(err.split()) and "Traceback" not in err


def test_goodput_carries_over_a_restart():
    first = [
        {"step": s, "started_at": 100.0, "step_time_s": 1.0, "productive_s": float(s)}
        for s in (1, 2, 3, 4)
    ]
    # resumed from the checkpoint of step 2: steps 3 and 4 are run again
    resumed = Goodput.resumed(first, start=2, now=200.0)
    assert resumed.started_at == 100.0
    assert resumed.productive_s == 2.0 and resumed.redone_s == 2.0
    assert Goodput.resumed([], start=2, now=200.0).started_at == 200.0


def test_gpu_flags_keep_the_users_values_and_start_this_jaxlib():
    mine = "--xla_gpu_enable_latency_hiding_scheduler=false"
    flags = with_gpu_flags(mine)
    assert flags.startswith(mine) and flags.count("latency_hiding_scheduler") == 1
    assert len(flags.split()) == len(GPU_FLAGS)
    # XLA aborts on a flag it does not know: every preset flag must exist in this jaxlib
    env = {**os.environ, "XLA_FLAGS": with_gpu_flags(""), "JAX_PLATFORMS": "cpu"}
    code = "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "3.0", out.stderr[-2000:]
