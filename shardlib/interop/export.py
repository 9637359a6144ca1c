"""Export a checkpoint's parameters in formats other tools read without shardlib.

* ``PATH.safetensors``: the safetensors layout (8-byte little-endian header length, a JSON
  header of name -> dtype/shape/byte range, then the raw little-endian bytes); the model
  and run config travel in the header's ``__metadata__``.
* ``PATH.npz``: numpy's zip of ``.npy`` files, one per tensor (``np.load(PATH)``).
* ``--format hf``: a Hugging Face directory, in the names of the model family's ``HFAdapter``
  (``shardlib.interop.hf_io.export_hf``).
* any other ``PATH``: a directory with a plain orbax checkpoint of the parameter tree
  (``PATH/params``, restorable by ``orbax.checkpoint.StandardCheckpointer``) and
  ``PATH/config.json``.

Only the parameters are read (not the optimizer state), as host numpy arrays: an export
is a full copy by nature, written by one process.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardlib.checkpoint.store import (
    CheckpointError,
    error_summary,
    host_fingerprint,
    load_orbax,
    read_meta,
)
from shardlib.parallel.pipeline.storage import BLOCKS, LayerOrder

SAFETENSORS_DTYPES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int32": "I32",
    "int64": "I64",
    "uint8": "U8",
    "bool": "BOOL",
}


@dataclass(frozen=True)
class Exported:
    path: Path
    step: int
    tensors: int
    bytes: int


def _nested(names: list[str]) -> dict:
    tree: dict = {}
    for name in names:
        *parents, leaf = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = 0
    return tree


def read_params(directory: str | Path, step: int | None = None) -> tuple[int, dict, dict]:
    """(step, {"embedding": array, "blocks/attn/wq": array, ...}, meta) as host arrays."""
    import jax

    step, meta = read_meta(directory, step)
    names = [n.removeprefix("params/") for n in meta["tensors"] if n.startswith("params/")]
    ocp = load_orbax()
    shape = {"params": _nested(names)}
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), shape)
    where = Path(directory) / str(step)
    try:
        tree = ocp.PyTreeCheckpointer().restore(
            where / "state",
            args=ocp.args.PyTreeRestore(
                item=shape, restore_args=restore_args, partial_restore=True
            ),
        )["params"]
    except Exception as err:  # orbax/tensorstore: many types, one meaning
        raise CheckpointError(
            f"checkpoint {where} cannot be read ({type(err).__name__}: {error_summary(err)})."
        ) from None
    flat, order = {}, LayerOrder.from_meta(meta)  # stacked rows back in layer order
    for name in names:
        node = tree
        for part in name.split("/"):
            node = node[part]
        saved = meta["tensors"]["params/" + name]
        node = np.asarray(node)
        if list(node.shape) != saved["shape"] or host_fingerprint(node) != saved["fingerprint"]:
            raise CheckpointError(
                f"checkpoint {where} is damaged: tensor params/{name} does not read back as "
                "saved (shape or fingerprint differs). Fix: export an earlier step."
            )
        flat[name] = order.natural_rows(node, name) if name.startswith(BLOCKS + "/") else node
    return step, flat, meta


def write_safetensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]):
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, x in tensors.items():
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[str(x.dtype)],
            "shape": list(x.shape),
            "data_offsets": [offset, offset + x.nbytes],
        }
        offset += x.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the format pads the header to 8 bytes
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for x in tensors.values():
            f.write(np.ascontiguousarray(x).tobytes())  # little-endian hosts (x86, arm)


def export(directory: str | Path, out: str | Path, *, step: int | None = None) -> Exported:
    """Write the parameters of ``step`` (default: latest complete) to ``out``.

    ``directory`` may be relative (``--checkpoint ckpt``): orbax reads absolute paths only.
    """
    step, tensors, meta = read_params(Path(directory).absolute(), step)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {"step": step, "model": meta["model"], "config": meta["config"]}
    if out.suffix == ".safetensors":
        write_safetensors(out, tensors, {k: json.dumps(v) for k, v in config.items()})
    elif out.suffix == ".npz":
        np.savez(out, **tensors)
    else:
        if out.exists():
            raise CheckpointError(f"export: {out} exists. Fix: choose a new directory.")
        out.mkdir()
        tree = _nested(list(tensors))
        for name, x in tensors.items():
            *parents, leaf = name.split("/")
            node = tree
            for p in parents:
                node = node[p]
            node[leaf] = x
        checkpointer = load_orbax().StandardCheckpointer()
        checkpointer.save((out / "params").absolute(), tree)
        checkpointer.wait_until_finished()
        (out / "config.json").write_text(json.dumps(config, indent=1))
    return Exported(
        path=out, step=step, tensors=len(tensors), bytes=sum(x.nbytes for x in tensors.values())
    )


def export_hf_checkpoint(directory: str | Path, out: str | Path, *, step: int | None = None):
    """A checkpoint's parameters as a Hugging Face directory (LoRA merged); the files.

    The checkpoint's model preset gives the Hugging Face names (``hf_adapter``); a model
    without an adapter fails here, before anything is written.
    """
    from shardlib.core.errors import ShardingError
    from shardlib.core.model import hf_adapter
    from shardlib.interop.hf_io import export_hf

    step, tensors, meta = read_params(Path(directory).absolute(), step)
    try:
        adapter = hf_adapter(meta["config"]["model"])
    except ShardingError as err:
        raise CheckpointError(f"export --format hf: checkpoint {directory}: {err}") from None
    return export_hf(tensors, meta["model"], adapter, out)
