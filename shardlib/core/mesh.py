"""Device meshes: named axes with sizes, read from small TOML presets.

A mesh is the one place where mesh axis names meet physical devices. Everything else in
shardlib talks about logical names (``embed``, ``heads``) and the rules table maps them onto
the axes defined here. Axis types are always ``Auto`` so that XLA's sharding propagation
(GSPMD) completes every layout we do not pin down; jax >= 0.7 would otherwise default to
``Explicit`` axes, where each op must be told its output sharding.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from shardlib.core.errors import ShardingError


class Axis(StrEnum):
    """The names of the built-in strategies' mesh axes, as constants.

    Which axes a mesh may have is not decided here: each strategy's plan section declares
    the axes it switches on (``ParallelPlan.known_axes``), so a new strategy names its axis
    in its own module. A bare ``MeshSpec`` is just named axes."""

    DATA = "data"  # pure data parallel: batch split, everything else replicated
    FSDP = "fsdp"  # ZeRO-3: batch split, parameters/grads/optimizer state sharded
    TENSOR = "tensor"  # Megatron tensor parallel
    TENSOR2 = "tensor2"  # second axis of 2D/3D tensor parallel
    TENSOR3 = "tensor3"  # third axis of 3D tensor parallel
    TENSOR_DEPTH = "tensor_depth"  # depth of 2.5D tensor parallel (Tesseract)
    CONTEXT = "context"  # context (sequence) parallel attention
    EXPERT = "expert"  # expert parallel (mixture of experts)
    STAGE = "stage"  # pipeline stages


def _presets_dir() -> Path:
    """The ``meshes`` package's folder: the mesh and cluster presets, installed with shardlib
    as package data (``pip install .`` ships them; no checkout needed)."""
    import meshes

    return Path(meshes.__file__).resolve().parent


MESHES_DIR = _presets_dir()


@dataclass(frozen=True)
class MeshSpec:
    """A mesh as named axes, before it is bound to devices.

    ``axes`` keeps the order of the preset: the last axis varies fastest over device ids, so
    fast (intra-host) axes go last. A size of ``-1`` means "the devices that are left".
    """

    axes: tuple[tuple[str, int], ...]
    """(axis name, size) pairs, outermost first; at most one size may be -1."""
    source: str = "<inline>"
    """Where the spec came from (a preset path), for error messages."""
    train: dict[str, Any] = field(default_factory=dict, compare=False)
    """Optional ``[train]`` overrides carried by the preset (e.g. written by the planner)."""
    platform: str | None = None
    """``"cpu"``: a preset for simulated CPU devices (the CLI creates as many as it needs)."""
    parallel: dict[str, Any] = field(default_factory=dict, compare=False)
    """The preset's ``[parallel.*]`` strategy tables (read by ``ParallelPlan``)."""
    distributed: dict[str, Any] = field(default_factory=dict, compare=False)
    """``[distributed]``: timeouts and job id of a multi-process run (``ProcessGroup``)."""
    rules: dict[str, Any] = field(default_factory=dict, compare=False)
    """``[rules]``: the model's own logical names -> mesh axes (``ParallelPlan.custom_names``)."""

    def __post_init__(self) -> None:
        names = [n for n, _ in self.axes]
        if not names:
            raise ShardingError(f"mesh {self.source}: no axes. Fix: add e.g. `[mesh] data = -1`.")
        if len(set(names)) != len(names):
            raise ShardingError(f"mesh {self.source}: axis names repeat: {names}.")
        wild = [n for n, s in self.axes if s == -1]
        if len(wild) > 1:
            raise ShardingError(
                f"mesh {self.source}: axes {wild} are both -1; only one axis may take "
                "'the devices that are left'. Fix: give all but one a size."
            )
        for n, s in self.axes:
            if not isinstance(s, int) or isinstance(s, bool) or (s < 1 and s != -1):
                raise ShardingError(
                    f"mesh {self.source}: axis {n!r} has size {s!r}; sizes are positive "
                    "integers or -1."
                )

    @property
    def fixed_size(self) -> int | None:
        """Devices the spec needs, or None when one axis is -1."""
        sizes = [s for _, s in self.axes]
        return None if -1 in sizes else math.prod(sizes)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    def sizes(self, num_devices: int) -> dict[str, int]:
        """Resolve ``-1`` against ``num_devices`` and check the product."""
        fixed = math.prod(s for _, s in self.axes if s != -1)
        wild = [n for n, s in self.axes if s == -1]
        if wild:
            if num_devices % fixed:
                raise ShardingError(
                    f"mesh {self.source}: the fixed axes multiply to {fixed}, which does not "
                    f"divide the {num_devices} devices, so {wild[0]!r} = -1 has no size. "
                    "Fix: choose sizes whose product divides the device count."
                )
            return {n: (num_devices // fixed if s == -1 else s) for n, s in self.axes}
        if fixed != num_devices:
            shape = " x ".join(f"{n}={s}" for n, s in self.axes)
            raise ShardingError(
                f"mesh {self.source}: {shape} needs {fixed} devices but {num_devices} are "
                f"available. Fix: make the sizes multiply to {num_devices}, set one axis to "
                f"-1, or simulate more CPU devices (shardlib.simulate_cpu_devices({fixed}))."
            )
        return dict(self.axes)

    def build(self, devices: list | None = None):
        """Bind to devices (default: all of ``jax.devices()``) as a mesh with Auto axes."""
        import jax
        from jax.sharding import AxisType, Mesh

        devices = list(jax.devices()) if devices is None else list(devices)
        sizes = self.sizes(len(devices))
        shape = tuple(sizes[n] for n in self.names)
        if len(devices) == len(jax.devices()) and jax.process_count() > 1:
            # Several hosts: process boundaries on the outermost axes.
            grid = hybrid_device_grid(list(shape), devices)
            return Mesh(grid, self.names, axis_types=(AxisType.Auto,) * len(shape))
        if len(devices) == len(jax.devices()):
            # make_mesh orders devices to follow the physical topology where it knows it.
            return jax.make_mesh(shape, self.names, axis_types=(AxisType.Auto,) * len(shape))
        grid = np.array(devices, dtype=object).reshape(shape)
        return Mesh(grid, self.names, axis_types=(AxisType.Auto,) * len(shape))


def mesh_spec(**axes: int) -> MeshSpec:
    """``mesh_spec(data=2, fsdp=-1)``: a spec from keyword sizes, in the order given."""
    return MeshSpec(tuple(axes.items()))


def load_mesh(path_or_name: str | os.PathLike) -> MeshSpec:
    """Read a preset: a path to a TOML file, or a preset name from ``meshes/``."""
    path = Path(path_or_name)
    if not path.exists() and not path.suffix:
        path = MESHES_DIR / f"{path_or_name}.toml"
    known = ", ".join(sorted(p.stem for p in MESHES_DIR.glob("*.toml")))
    if not path.exists():
        raise ShardingError(f"mesh preset {str(path_or_name)!r} not found. Presets: {known}.")
    if path.is_dir():  # opening it would be an IsADirectoryError traceback
        inside = sorted(p.name for p in path.glob("*.toml"))
        example = path / inside[0] if inside else path / "NAME.toml"
        raise ShardingError(
            f"mesh {str(path_or_name)!r} is a directory, not a mesh file ({len(inside)} TOML "
            f"files in it). Fix: name a file, e.g. --mesh {example}, or a preset: {known}."
        )
    with path.open("rb") as f:
        doc = tomllib.load(f)
    if "mesh" not in doc and "cluster" in doc:  # hardware, not a layout
        raise ShardingError(
            f"mesh {path}: a cluster description ([cluster]), not a mesh. Fix: "
            f"`shardlib plan --cluster {path}` writes a mesh for it."
        )
    if "mesh" not in doc:
        raise ShardingError(f"mesh {path}: no [mesh] table. Fix: add `[mesh]` with axis sizes.")
    return MeshSpec(
        tuple(doc["mesh"].items()),
        source=str(path),
        train=doc.get("train", {}),
        platform=doc.get("platform"),
        parallel=doc.get("parallel", {}),
        distributed=doc.get("distributed", {}),
        rules=doc.get("rules", {}),
    )


def single_device_mesh(names: tuple[str, ...] = (Axis.DATA,)):
    """A mesh over the first device with every axis of size 1: the parity reference."""
    import jax

    return MeshSpec(tuple((n, 1) for n in names)).build(jax.devices()[:1])


def reference_mesh(mesh: Any = None):
    """The one-device mesh to compare a layout with: the same axis names, every axis size 1.

    ``mesh`` is a built mesh, a ``MeshSpec``, a tuple of axis names, or None (one ``data``
    axis). Keeping the names lets the very same rules and ``constrain`` calls run on it: every
    split becomes a split into one piece, so the program is the unsharded one.
    """
    if mesh is None:
        names: tuple[str, ...] = (Axis.DATA,)
    elif isinstance(mesh, MeshSpec):
        names = mesh.names
    elif hasattr(mesh, "axis_names"):
        names = tuple(mesh.axis_names)
    else:
        names = tuple(mesh)
    return single_device_mesh(names)


def simulate_cpu_devices(n: int) -> None:
    """Make the CPU backend expose ``n`` fake devices.

    XLA reads the flag once, when JAX first initialises its backend; afterwards the device
    count is fixed. Call this before any JAX computation (ideally before importing models).
    """
    import jax

    try:
        from jax._src import xla_bridge

        started = bool(xla_bridge._backends)  # noqa: SLF001 - no public "is initialised" probe
    except Exception:  # pragma: no cover - private layout changed: assume not started
        started = False
    if started:
        have = jax.local_device_count()  # this process's devices (several in multi-host runs)
        if have == n:
            return
        raise ShardingError(
            f"simulate_cpu_devices({n}) was called after JAX initialised its backend with "
            f"{have} device(s). Fix: call it first thing, before any jax operation, or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} in the environment."
        )
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    flags.append(f"--xla_force_host_platform_device_count={n}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS", "cpu") or "cpu")


def split_over_hosts(sizes: list[int], hosts: int) -> tuple[list[int], list[int]]:
    """(inner per-host sizes, across-host sizes): hosts fill the outermost axes first.

    ``[2, 2, 2]`` over 2 hosts -> inner ``[1, 2, 2]``, across ``[2, 1, 1]``: the data axis
    crosses hosts, fsdp and tensor stay inside one.
    """
    across, left = [], hosts
    for size in sizes:
        share = math.gcd(size, left)
        across.append(share)
        left //= share
    if left != 1:
        raise ShardingError(
            f"mesh: axis sizes {sizes} cannot be split over {hosts} hosts (each host must "
            "hold an equal block of the mesh). Fix: make the outer axes a multiple of the "
            "process count."
        )
    return [s // a for s, a in zip(sizes, across, strict=True)], across


def hybrid_device_grid(sizes: list[int], devices: list) -> np.ndarray:
    """Devices arranged as ``sizes`` with process boundaries on the outermost axes."""
    from jax.experimental import mesh_utils

    hosts = len({d.process_index for d in devices})
    inner, across = split_over_hosts(sizes, hosts)
    return mesh_utils.create_hybrid_device_mesh(inner, across, devices, process_is_granule=True)
