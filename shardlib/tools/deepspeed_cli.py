"""``shardlib train --deepspeed``: a ds_config.json as the run's base config, and the devices
to simulate for it when no mesh is given (``shardlib.interop.deepspeed`` does the mapping)."""

from __future__ import annotations

import dataclasses

from rich.console import Console
from rich.markup import escape

from shardlib.core.mesh import load_mesh


def deepspeed_devices(path: str, default_mesh: str) -> int:
    """The CPU devices to simulate for a ds_config given without a mesh: those its batch
    identity implies, else the default preset's."""
    from shardlib.interop.deepspeed import implied_devices, read_deepspeed

    n = implied_devices(read_deepspeed(path))
    why = "train_batch_size / (micro batch x accumulation)" if n else f"the {default_mesh} preset's"
    n = n or load_mesh(default_mesh).fixed_size
    Console(stderr=True).print(f"--deepspeed without --mesh: {n} simulated CPU devices ({why})")
    return n


def deepspeed_base(path: str, devices: int, platform: str | None, rules=None):
    """The config a ds_config.json describes on ``devices`` devices; prints the equivalent
    command and the notes. ``rules``: the mesh file's ``[rules]`` (the model's own names)."""
    from shardlib.interop.deepspeed import load_deepspeed

    ds = load_deepspeed(path, devices)
    console = Console(stderr=True)
    console.print(f"[bold]--deepspeed {escape(path)}[/] is: {escape(ds.command())}", soft_wrap=True)
    for note in ds.notes:
        console.print(f"  note: {escape(note)}", soft_wrap=True)
    return deepspeed_train_config(ds, platform=platform, source=path, rules=rules)


def deepspeed_train_config(
    ds, *, platform: str | None = None, source: str = "ds_config", rules=None
):
    """The TrainConfig a mapped ds_config (``DeepSpeedPlan``) describes: its settings on its
    mesh axes, shardlib's defaults for the rest."""
    from shardlib.core.mesh import mesh_spec
    from shardlib.parallel.plan import ParallelPlan
    from shardlib.train.config import TrainConfig, override

    mesh = dataclasses.replace(mesh_spec(**ds.mesh), platform=platform, source=source)
    plan = ParallelPlan(mesh=mesh).with_names(rules or {})  # the model's own names stay
    return override(TrainConfig(parallel=plan), ds.settings)
