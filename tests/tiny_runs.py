"""Tiny training runs shared by the checkpoint and multi-process tests (cached per process).

Compiling a train step costs seconds; a step of this model costs milliseconds. So every
test uses the same config (40 steps, so that a run can be interrupted anywhere) and each
(mesh, checkpoint_dir) setup is built and compiled once per pytest process.
"""

import atexit
import math
import shutil
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import jax
import numpy as np

from shardlib.checkpoint.store import complete_steps, fingerprints, tensor_names
from shardlib.core.mesh import MeshSpec
from shardlib.train.config import override, train_config
from shardlib.train.loop import run
from shardlib.train.setup import TrainSetup, make_setup

STEPS = 40
TINY = train_config(model="llama-tiny", steps=STEPS, batch=8, seq=16, **{"model.layers": 1})
# The same settings as command-line words, for subprocesses.
TINY_ARGS = ["model.layers=1", f"steps={STEPS}", "batch=8", "seq=16"]

ONE = (("data", 1),)
DP8 = (("data", 8),)
FSDP8 = (("fsdp", 8),)
CUBE = (("data", 2), ("fsdp", 2), ("tensor", 2))


@cache
def setup(axes: tuple[tuple[str, int], ...], checkpoint_dir: str | None = None) -> TrainSetup:
    """TINY on a mesh over the first prod(sizes) devices."""
    n = math.prod(size for _, size in axes)
    mesh = MeshSpec(axes).build(jax.devices()[:n])
    cfg = override(TINY, {"checkpoint_dir": checkpoint_dir})
    if checkpoint_dir:
        cfg = override(cfg, {"checkpoint_every": 10, "keep": 2})
    return make_setup(cfg, mesh)


@cache
def _initial_host_state() -> dict:
    return jax.device_get(setup(ONE).init_state())


def initial_state(axes: tuple[tuple[str, int], ...]) -> dict:
    """The one-device initialisation laid out for ``axes`` (saves compiling each mesh's init;
    the values are the same as its own sharded initialisation would give)."""
    return jax.device_put(_initial_host_state(), setup(axes).state_shardings)


@cache
def losses(axes: tuple[tuple[str, int], ...], steps: int = STEPS) -> tuple[float, ...]:
    """The first ``steps`` losses of an uninterrupted run without checkpoints."""
    return tuple(run(setup(axes), state=initial_state(axes), show=False, stop_after=steps).losses)


def scratch_dir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


@dataclass(frozen=True)
class CubeRuns:
    """A 2x2x2 run stopped after step 3 and resumed, and the same run uninterrupted."""

    directory: Path
    """The resumed run's checkpoints (every 10 steps, keep 2)."""
    steps_kept: list[int]
    uninterrupted: list[float]
    stopped: list[float]
    resumed: list[float]
    resumed_first_step: int
    fingerprints_match: bool
    """The final states of both runs have the same fingerprints (bitwise equal)."""
    final_params: dict[str, np.ndarray]
    """The resumed run's final parameters, gathered to host, by name."""


@cache
def cube_runs() -> CubeRuns:
    directory = scratch_dir("shardlib-cube-") / "run"
    cube = setup(CUBE, str(directory))
    # The same setup (so one compilation) writes the uninterrupted run's checkpoints first;
    # they are deleted before the interrupted run starts from scratch in the same place.
    uninterrupted = run(cube, state=initial_state(CUBE), show=False)
    shutil.rmtree(directory)
    stopped = run(cube, state=initial_state(CUBE), show=False, stop_after=3)
    resumed = run(cube, show=False)
    params = resumed.state["params"]
    return CubeRuns(
        directory=directory,
        steps_kept=complete_steps(directory),
        uninterrupted=uninterrupted.losses,
        stopped=stopped.losses,
        resumed=resumed.losses,
        resumed_first_step=resumed.records[0]["step"],
        fingerprints_match=fingerprints(uninterrupted.state) == fingerprints(resumed.state),
        final_params=dict(
            zip(tensor_names(params), jax.device_get(jax.tree.leaves(params)), strict=True)
        ),
    )
