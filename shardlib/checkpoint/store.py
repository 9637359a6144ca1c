"""Checkpoints with orbax: asynchronous, kept to a budget, complete-or-ignored, any mesh.

A checkpoint is one step directory ``<checkpoint_dir>/<step>/`` with two orbax items:
``state`` (parameters, optimizer state and step, as sharded arrays: each process writes
only the shards it holds) and ``meta`` (JSON: the run's config, the model config, the mesh
it was written on, the data position and RNG seed, and each tensor's shape, dtype and
fingerprint). Orbax writes into a temporary directory and renames it when every process
has finished, so a crash mid-save leaves only a ``*.orbax-checkpoint-tmp*`` directory that
listing and restoring ignore (and the next run's saver removes).

Restoring reads the arrays straight into the *target* shardings of any mesh: each device
reads only the slices it will hold, so nothing is ever gathered onto one device. Before
reading, shapes and dtypes are checked against the target (a checkpoint of another model
fails naming the tensor); after reading, each tensor's fingerprint is recomputed on the
devices and compared with the one recorded at save time, which catches damaged files that
the storage layer would decode silently (a flipped byte in a compressed chunk). Damage
raises ``DamagedCheckpoint`` naming the tensor (one that fails to read is found by reading
each tensor on its own), so that a resume can fall back to an older step
(``shardlib.checkpoint.tiers``). The batches
are a pure function of (seed, step), so the step *is* the data position. Writing is
``shardlib.checkpoint.saver``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from shardlib.checkpoint.agreement import first_said, on_this_process
from shardlib.checkpoint.quiet import dropping_failed_reads, quiet_closed_loop, quiet_reads_alone
from shardlib.core.errors import ShardingError
from shardlib.parallel.pipeline.storage import LayerOrder

FORMAT = "shardlib-checkpoint/1"
TMP_MARK = ".orbax-checkpoint-tmp"


class CheckpointError(ShardingError):
    """A checkpoint directory that is missing, damaged, or belongs to another model."""


class DamagedCheckpoint(CheckpointError):
    """One step that cannot be read back as saved: a resume may fall back to an older one."""

    def __init__(self, message: str, *, step: int, what: str) -> None:
        super().__init__(message)
        self.step = step
        self.what = what
        """What is damaged: ``tensor NAME`` where one is known, else the part of the step."""


def load_orbax():
    # orbax pulls in tensorstore and a thread pool: import it only where checkpoints are used.
    import orbax.checkpoint as ocp

    return ocp


# --- tensor names and fingerprints -------------------------------------------------------


def _key_name(key) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def tensor_names(tree) -> list[str]:
    """``params/blocks/attn/wq``-style names of the leaves, in ``jax.tree.leaves`` order."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return ["/".join(_key_name(k) for k in path) for path, _ in flat]


def _fingerprint(x: jax.Array) -> jax.Array:
    """[2] uint32: the sum, and the position-weighted sum, of the raw bits mod 2**32.

    Integer sums mod 2**32 do not depend on the order of addition, so the value is the same
    whatever the mesh and the layout: it identifies the bits, not how they are sharded.
    """
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
        bits = bits.astype(jnp.uint32) if x.dtype.itemsize < 4 else bits
    index = jnp.arange(bits.size, dtype=jnp.uint32).reshape(bits.shape)
    weighted = bits * (2 * index + 1)
    return jnp.stack([jnp.sum(bits, dtype=jnp.uint32), jnp.sum(weighted, dtype=jnp.uint32)])


def host_fingerprint(x: np.ndarray, chunk: int = 1 << 22) -> str:
    """``_fingerprint`` of a host array, in numpy (uint64 arithmetic wraps mod 2**64), read
    ``chunk`` elements at a time: a file-backed array (the NVMe tier's) is never whole in
    memory."""
    flat = np.ascontiguousarray(x).reshape(-1)
    total = weighted = 0
    for start in range(0, flat.size, chunk):
        part = flat[start : start + chunk]
        bits = part.astype(np.uint32) if x.dtype == np.bool_ else part.view(f"uint{8 * x.itemsize}")
        bits = bits.astype(np.uint64)
        index = np.arange(start, start + bits.size, dtype=np.uint64)
        total += int(bits.sum())
        weighted += int((bits * (2 * index + 1)).sum())
    return f"{total % 2**32:08x}{weighted % 2**32:08x}"


def _on_device(x: jax.Array) -> jax.Array:
    """``x`` in device memory: host-memory arrays (offloaded optimizer state) cannot meet
    device values in one operation, so they are fingerprinted on the device."""
    if getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host:
        return jax.device_put(x, jax.memory.Space.Device)
    return x


@jax.jit
def _fingerprints(tree) -> jax.Array:
    return jnp.stack([_fingerprint(_on_device(x)) for x in jax.tree.leaves(tree)])  # [leaves, 2]


def fingerprints(tree) -> list[str]:
    """One 16-hex-digit fingerprint per leaf, computed where the shards are (a numpy leaf,
    such as the NVMe tier's files, on the host)."""
    leaves = jax.tree.leaves(tree)
    arrays = [x for x in leaves if not isinstance(x, np.ndarray)]
    values = iter(np.asarray(jax.device_get(_fingerprints(arrays))) if arrays else ())
    return [
        host_fingerprint(x) if isinstance(x, np.ndarray) else "{:08x}{:08x}".format(*next(values))
        for x in leaves
    ]


# --- metadata -----------------------------------------------------------------------------


def jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple | list):
        return [jsonable(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, int | float | str | bool) or obj is None:
        return obj
    return str(obj)


def build_meta(setup, state: dict, step: int, data: dict | None = None) -> dict:
    """Everything besides the arrays that a resumed or exported run needs to know.

    ``data`` describes the tokens read (``train.data.data_identity``): a resume compares it.
    """
    from shardlib.core.layout import mesh_axes

    names = tensor_names(state)
    leaves = jax.tree.leaves(state)
    return {
        "format": FORMAT,
        "step": step,
        "config": jsonable(setup.cfg),
        "model": jsonable(setup.model_cfg),
        "mesh": {"axes": mesh_axes(setup.mesh), "processes": jax.process_count()},
        "data": {
            "seed": setup.cfg.run.seed,
            "next_step": step,
            "source": setup.cfg.dataset.path,
            "identity": data,
        },
        "rng": {"seed": setup.cfg.run.seed, "impl": str(jax.config.jax_default_prng_impl)},
        "layer_order": setup.layer_order.meta(),  # stacked rows as the step holds them
        "tensors": {
            name: {"shape": list(x.shape), "dtype": str(x.dtype), "fingerprint": fp}
            for name, x, fp in zip(names, leaves, fingerprints(state), strict=True)
        },
    }


# --- reading ------------------------------------------------------------------------------


def complete_steps(directory: str | Path) -> list[int]:
    """Steps with a complete checkpoint (unfinished saves are not listed); [] if none."""
    path = Path(directory)
    if not path.is_dir():
        return []
    return sorted(load_orbax().path.step.checkpoint_steps(path))


def _check_directory(directory: str | Path) -> Path:
    path = Path(directory)
    if not path.exists():
        raise CheckpointError(
            f"checkpoint directory {str(path)!r} does not exist. Fix: check the path (with "
            "resume=auto a run starts fresh and creates it)."
        )
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {str(path)!r} is a file, not a directory.")
    return path


def read_meta(directory: str | Path, step: int | None = None) -> tuple[int, dict]:
    """(step, meta) of ``step`` (default: the latest complete one), with clear errors."""
    path = _check_directory(directory)
    steps = complete_steps(path)
    if not steps:
        partial = sorted(p.name for p in path.iterdir() if TMP_MARK in p.name)
        raise CheckpointError(
            f"checkpoint directory {str(path)!r} holds no complete checkpoint"
            + (f" (unfinished saves, ignored: {', '.join(partial)})" if partial else "")
            + ". Fix: point checkpoint_dir at a run's directory, or start with resume=never."
        )
    step = steps[-1] if step is None else step
    if step not in steps:
        raise CheckpointError(f"checkpoint {path}: no step {step}; complete steps: {steps}.")
    meta_file = path / str(step) / "meta" / "metadata"
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as err:
        raise DamagedCheckpoint(
            f"checkpoint {path / str(step)} is damaged: its metadata ({meta_file.name}) cannot "
            f"be read ({type(err).__name__}: {err}). Fix: restore an earlier step, or delete "
            "this step directory.",
            step=step,
            what=f"its metadata ({meta_file.name})",
        ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path / str(step)} was not written by shardlib ({FORMAT} metadata "
            "missing)."
        )
    return step, meta


def _model_differences(meta: dict, model_cfg) -> str:
    saved, wanted = meta.get("model", {}), jsonable(model_cfg)
    diff = [
        f"{k}={saved.get(k)!r} (this run: {v!r})" for k, v in wanted.items() if saved.get(k) != v
    ]
    return "; the checkpoint's model has " + ", ".join(diff) if diff else ""


def check_compatible(meta: dict, target, model_cfg, where: str) -> None:
    """Same tensors, shapes and dtypes as ``target``; else name the first that differs."""
    saved = meta["tensors"]
    wanted = dict(zip(tensor_names(target), jax.tree.leaves(target), strict=True))
    problems = [f"{n}: not in the checkpoint" for n in wanted if n not in saved]
    problems += [f"{n}: in the checkpoint, not in this model" for n in saved if n not in wanted]
    for name, x in wanted.items():
        if name in saved:
            s = saved[name]
            if tuple(s["shape"]) != tuple(x.shape) or s["dtype"] != str(x.dtype):
                problems.append(
                    f"{name}: checkpoint {s['dtype']}{s['shape']}, this run "
                    f"{x.dtype}{list(x.shape)}"
                )
    if problems:
        problems.sort(key=lambda p: not p.startswith("params/"))  # parameters say it best
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(
            f"checkpoint {where} belongs to another model: "
            + "; ".join(problems[:3])
            + more
            + _model_differences(meta, model_cfg)
            + ". Fix: use the same model settings as the saved run, or another checkpoint_dir."
        )


def error_summary(err: Exception) -> str:
    """The useful part of an orbax/tensorstore error (they append a page of spec JSON)."""
    text = str(err).strip().split(" See full TensorStore details")[0]
    return (text.splitlines() or [""])[0][:300]


def _reader():
    """An orbax reader; with several processes one that meets no other process at orbax's
    barriers, each process reading the shards it needs (of its own copy, in the local tier;
    of the shared step, in the persistent one). Orbax's own multi-process restore has
    barriers that a process whose read failed never reaches: the others waited there, or met
    that process's next barrier instead and then read another step's verdict. The processes
    agree on the outcome afterwards (``checkpoint.agreement``)."""
    ocp = load_orbax()
    if jax.process_count() == 1:
        return ocp.Checkpointer(ocp.StandardCheckpointHandler())
    quiet_reads_alone()
    alone = ocp.options.MultiprocessingOptions(
        primary_host=None, active_processes={jax.process_index()}, barrier_sync_key_prefix="own"
    )
    handler = ocp.StandardCheckpointHandler(multiprocessing_options=alone)
    return ocp.Checkpointer(handler, multiprocessing_options=alone)


def _unreadable(state_dir: Path, target) -> str:
    """Which tensors of a step that failed to read cannot be read, each read on its own
    (orbax's partial restore; one damaged data file can hold many tensors)."""
    ocp = load_orbax()
    leaves, treedef = jax.tree.flatten(target)
    bad = []
    reader = _reader()
    for i, name in enumerate(tensor_names(target)):
        one = jax.tree.unflatten(treedef, [x if j == i else None for j, x in enumerate(leaves)])
        try:
            reader.restore(state_dir.absolute(), ocp.args.StandardRestore(one, strict=False))
        except Exception:  # as in restore: every error means this tensor is unreadable
            bad.append(name)
    reader.close()
    if not bad:
        return "its arrays"
    bad.sort(key=lambda n: not n.startswith("params/"))  # parameters say it best
    return f"tensor {bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")


@dataclass(frozen=True)
class Restored:
    """A state read back onto the target mesh, with the metadata it was saved with."""

    state: dict
    step: int
    path: Path
    """The step directory it came from."""
    meta: dict


def restore(directory: str | Path, setup, step: int | None = None) -> Restored:
    """Read ``step`` (default: latest complete) straight into ``setup``'s shardings.

    Read-only: a failure here changes nothing on disk. With several processes each reads
    the shards it needs without orbax's barriers (``_reader``), and a tensor that one of
    them cannot read makes every process raise ``DamagedCheckpoint`` naming it.
    """
    step, meta = read_meta(directory, step)
    path = Path(directory)
    where = str(path / str(step))
    target = setup.abstract_state()
    check_compatible(meta, target, setup.model_cfg, where)
    ocp = load_orbax()
    failure = None
    try:
        with _reader() as reader:
            state = reader.restore(
                (path / str(step) / "state").absolute(), ocp.args.StandardRestore(target)
            )
    except Exception as err:  # orbax/tensorstore raise many types; all mean "unreadable"
        failure = f"{type(err).__name__}: {error_summary(err)}"
    said = ""  # what this process could not read, and why
    if failure is not None:  # outside the handler: the error's frames can be collected
        quiet_closed_loop()
        with dropping_failed_reads():
            said = f"{_unreadable(path / str(step) / 'state', target)}{on_this_process()}"
        said += f"\n{failure}"
    said = first_said(said)  # every process: the first failed process's words, or ""
    if said:
        what, failure = said.split("\n", 1)
        raise DamagedCheckpoint(
            f"checkpoint {where} is damaged or incomplete and cannot be read: {what} "
            f"({failure}). Fix: restore an earlier step (complete steps: "
            f"{complete_steps(path)}), or delete this step directory.",
            step=step,
            what=what,
        )
    saved = meta["tensors"]
    for name, fp in zip(tensor_names(state), fingerprints(state), strict=True):
        if saved[name]["fingerprint"] != fp:
            raise DamagedCheckpoint(
                f"checkpoint {where} is damaged: tensor {name} reads back with fingerprint "
                f"{fp}, but {saved[name]['fingerprint']} was saved. Fix: restore an earlier "
                f"step (complete steps: {complete_steps(path)}), or delete this step directory.",
                step=step,
                what=f"tensor {name}",
            )
    state = setup.stored(state, LayerOrder.from_meta(meta))  # saved under another plan
    return Restored(state=state, step=step, path=path / str(step), meta=meta)
