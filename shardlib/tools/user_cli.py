"""The command line's side of a model of one's own: ``loss=`` and ``data=``.

``shardlib train model=pkg.mod:factory loss=pkg.mod:loss_fn data=pkg.mod:batches`` trains
any annotated NNX model through the generic trainer (``train.user_model``); ``explain``
takes the same words. ``data=`` names a ``shardlib.Batches`` (or a function of no
arguments returning one), which declares the logical names of the batch's dims. Without
``loss=pkg.mod:NAME`` the words keep their token-trainer meanings (``data=`` a token
file). The decoder-only commands (``generate``, ``export --format hf``) refuse such a
model up front, with the reason.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from shardlib.core.errors import ShardingError

DECODER_ONLY = {
    "export --format hf": "a Hugging Face export names a decoder's parameters (its adapter)",
    "generate": "generate continues token prompts through a decoder's embed, blocks and head",
}


@dataclass(frozen=True)
class OwnModel:
    """The ``loss=`` and ``data=`` words of a command line (references, not yet imported)."""

    loss: str
    data: str | None


def split_words(words: list[str]) -> tuple[list[str], OwnModel | None]:
    """``words`` less ``loss=pkg.mod:NAME`` and ``data=pkg.mod:NAME``; those as ``OwnModel``
    (None when there is no ``loss=`` of that form: a token run)."""
    pairs = [w.partition("=") for w in words]
    loss = [v for k, _, v in pairs if k == "loss" and ":" in v]
    if not loss:
        return words, None
    data = [v for k, _, v in pairs if k in ("data", "dataset")]
    rest = [
        w for w, (k, _, _) in zip(words, pairs, strict=True) if k not in ("loss", "data", "dataset")
    ]
    own = OwnModel(loss[-1], data[-1] if data else None)
    if own.data is None or ":" not in own.data:
        raise ShardingError(
            f"loss={own.loss} trains the model through its own loss, which reads its own batches"
            f"{'' if own.data is None else f', not a token file ({own.data})'}. Fix: "
            "data=pkg.mod:NAME naming a shardlib.Batches (or a function returning one) with "
            "the logical names of the batch's dims."
        )
    return rest, own


def resolve(ref: str, what: str):
    """The object ``pkg.mod:NAME`` names, or a ShardingError with the fix."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ShardingError(
            f"{what}={ref}: cannot import {module_name!r} ({err}). Fix: put the package on "
            "PYTHONPATH (or install it)."
        ) from err
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if n[:1] != "_")
        raise ShardingError(
            f"{what}={ref}: {module_name} has no {attr!r}. Fix: one of {', '.join(public)}."
        )
    return getattr(module, attr)


def setup(cfg, mesh, own: OwnModel):
    """The generic trainer's setup for ``cfg.model`` with this loss and these batches."""
    from shardlib.train.user_data import as_batches
    from shardlib.train.user_model import make_model_setup

    loss = resolve(own.loss, "loss")
    if not callable(loss):
        raise ShardingError(
            f"loss={own.loss} is a {type(loss).__name__}, not a function. Fix: name "
            "loss_fn(model, batch) -> (loss, metrics)."
        )
    data = as_batches(resolve(own.data, "data"), name=own.data)
    return make_model_setup(cfg, cfg.model, loss, data, mesh)


def check_parity(cfg, mesh, own: OwnModel):
    """``shardlib parity`` for a model of one's own: the same run on ``mesh`` and on one
    device (the same axis names, each of size 1), per-step losses and gradient norms
    compared (the first step's gradients are the token trainer's to trace)."""
    import dataclasses

    from shardlib.core.mesh import reference_mesh
    from shardlib.tools.parity import compare_traces, trace

    cfg = dataclasses.replace(cfg, checkpoint=type(cfg.checkpoint)())  # nothing written
    got = trace(setup(cfg, mesh, own), grads=False)
    ref = trace(setup(cfg, reference_mesh(mesh), own), grads=False)
    return compare_traces(got, ref)


def refuse_decoder_only(command: str, own: OwnModel | None, checkpoint: str | None = None):
    """A decoder-only command asked of a model of one's own (its words, or a checkpoint it
    wrote: the checkpoint's model records its loss) fails here, before anything is built."""
    reason = DECODER_ONLY.get(command, f"{command} needs a decoder")
    if own is not None:
        raise ShardingError(
            f"{command} with loss={own.loss}: {reason}; a model of your own has none. Fix: "
            f"shardlib train (or explain) with loss= and data=, or drop them for a decoder."
        )
    if not checkpoint or not Path(checkpoint).is_dir():
        return
    from shardlib.checkpoint.store import CheckpointError, read_meta

    try:
        _, meta = read_meta(checkpoint)
    except (CheckpointError, ShardingError, OSError):
        return  # the command itself says what is wrong with the directory
    model = meta.get("model")
    if isinstance(model, dict) and model.get("loss"):
        raise ShardingError(
            f"{command}: checkpoint {checkpoint} holds {model.get('factory')}, trained through "
            f"its own loss ({model['loss']}); {reason}, which it does not have. Fix: shardlib "
            f"export --checkpoint {checkpoint} --out params.safetensors (shardlib's format), "
            "and load the parameters into your model."
        )
