"""``shardlib data prepare``: text, JSON lines or a saved HF dataset -> token shards + index.

Inputs (any mix, in order): text files (each file is one document), JSON lines (one
document per line: ``{"text": ...}``, or ``{"prompt": ..., "completion": ...}`` whose prompt
tokens carry no loss) and directories written by ``datasets``' ``save_to_disk`` (same
columns; ``datasets`` is an optional dependency). Tokenized with a ``tokenizers``
``tokenizer.json`` or a sentencepiece ``.model`` given by path: nothing is downloaded.

The output directory (``docs/data.md``) holds ``index.json`` and flat token shards, uint16
when the vocabulary allows (<= 65,536 ids) else int32, split into ``train`` and a held-out
``eval`` share of whole documents. Everything is written into a temporary directory that
is renamed at the end: an error leaves nothing behind, and an existing output is refused.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from shardlib.core.errors import ShardingError
from shardlib.dataset.index import FORMAT, INDEX, file_sha256

EOS_NAMES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|eos|>")
SHARD_TOKENS = 1 << 28  # tokens per shard at most (512 MiB of uint16)


@dataclass(frozen=True)
class Doc:
    """One document: its text, or a prompt and the completion that alone carries loss."""

    text: str
    prompt: str | None = None
    where: str = ""  # file:line, for errors


class Tokenizer:
    """A ``tokenizers`` tokenizer.json or a sentencepiece .model, read from a local path."""

    def __init__(self, path: str, eos: str = "auto") -> None:
        p = Path(path)
        if not p.is_file():
            raise ShardingError(
                f"--tokenizer {path!r}: no such file. Fix: a tokenizer.json "
                "or a sentencepiece .model file."
            )
        self.path, self.sha256 = str(p), file_sha256(p)
        if p.suffix == ".model":
            import sentencepiece

            sp = sentencepiece.SentencePieceProcessor(model_file=str(p))
            self.kind, self.vocab_size = "sentencepiece", sp.get_piece_size()
            self._encode = lambda text, first: sp.encode(text)
            self._id = lambda tok: (
                sp.piece_to_id(tok) if sp.piece_to_id(tok) != sp.unk_id() else None
            )
            auto_eos = sp.eos_id() if sp.eos_id() >= 0 else None
        else:
            try:
                from tokenizers import Tokenizer as HFTokenizer
            except ImportError:
                raise ShardingError(
                    "--tokenizer: reading tokenizer.json needs the `tokenizers` "
                    "package. Fix: pip install tokenizers."
                ) from None
            try:
                tok = HFTokenizer.from_file(str(p))
            except Exception as err:
                raise ShardingError(
                    f"--tokenizer {path!r} is not a tokenizers tokenizer.json ({err})."
                ) from None
            self.kind, self.vocab_size = "tokenizers", tok.get_vocab_size(with_added_tokens=True)
            self._encode = lambda text, first: tok.encode(text, add_special_tokens=first).ids
            self._id = tok.token_to_id
            auto_eos = next(
                (tok.token_to_id(n) for n in EOS_NAMES if tok.token_to_id(n) is not None), None
            )
        if eos == "auto":
            self.eos_id = auto_eos
        elif eos == "none":
            self.eos_id = None
        else:
            self.eos_id = self._id(eos)
            if self.eos_id is None:
                raise ShardingError(
                    f"--eos {eos!r} is not a token of {path}. Fix: --eos auto, "
                    "none, or one of its special tokens."
                )

    def encode(self, doc: Doc) -> tuple[list[int], int]:
        """(token ids, prompt length): prompt (special tokens as the tokenizer adds them),
        then completion or text, then end-of-sequence when there is one."""
        if doc.prompt is None:
            ids, prompt = list(self._encode(doc.text, True)), 0
        else:
            head = list(self._encode(doc.prompt, True))
            ids, prompt = head + list(self._encode(doc.text, False)), len(head)
        return ids + ([self.eos_id] if self.eos_id is not None else []), prompt


def _from_record(record, where: str) -> Doc:
    if isinstance(record, dict) and isinstance(record.get("text"), str):
        return Doc(record["text"], where=where)
    if (
        isinstance(record, dict)
        and isinstance(record.get("prompt"), str)
        and isinstance(record.get("completion"), str)
    ):
        return Doc(record["completion"], prompt=record["prompt"], where=where)
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise ShardingError(
        f"{where}: a record needs a string `text`, or string `prompt` and `completion`; it has "
        f"{keys}. Fix: rename the fields (or drop the record)."
    )


def read_documents(inputs: list[str]) -> Iterator[Doc]:
    """Documents of every input in order (checked: bad JSON names its file and line)."""
    for name in inputs:
        p = Path(name)
        if p.is_dir():
            yield from _hf_dataset(p)
        elif not p.is_file():
            raise ShardingError(f"input {name!r}: no such file or directory.")
        elif p.suffix in (".jsonl", ".json"):
            with open(p, encoding="utf-8") as f:
                for line_no, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as err:
                        raise ShardingError(
                            f"{p}:{line_no}: not JSON ({err}). Fix: one JSON object per line."
                        ) from None
                    yield _from_record(record, f"{p}:{line_no}")
        else:
            yield Doc(p.read_text(encoding="utf-8"), where=str(p))


def _hf_dataset(path: Path) -> Iterator[Doc]:
    try:
        import datasets
    except ImportError:
        raise ShardingError(
            f"input {str(path)!r} is a directory: reading a saved Hugging Face "
            "dataset needs `datasets`. Fix: pip install datasets."
        ) from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
    for i, record in enumerate(ds):
        yield _from_record(record, f"{path}[{i}]")


def _write_split(out: Path, split: str, docs: list, dtype, shard_tokens: int) -> dict:
    """One split's shards (document-aligned) and their index entries."""
    shards, current, size = [], [], 0

    def flush():
        nonlocal current, size
        if not current:
            return
        name = f"{split}-{len(shards):05d}.bin"
        ids = np.concatenate([np.asarray(t, np.int64) for t, _ in current]).astype(dtype)
        ids.tofile(out / name)
        lengths = [len(t) for t, _ in current]
        prompts = [p for _, p in current]
        shards.append(
            {
                "file": name,
                "tokens": int(ids.size),
                "sha256": file_sha256(out / name),
                "offsets": [0, *np.cumsum(lengths).tolist()],
                "prompt_tokens": prompts if any(prompts) else None,
            }
        )
        current, size = [], 0

    for ids, prompt in docs:
        if size and size + len(ids) > shard_tokens:
            flush()
        current.append((ids, prompt))
        size += len(ids)
    flush()
    return {"documents": len(docs), "tokens": sum(s["tokens"] for s in shards), "shards": shards}


def prepare(
    inputs: list[str],
    tokenizer: str,
    out: str,
    *,
    eval_fraction: float = 0.05,
    seed: int = 0,
    eos: str = "auto",
    shard_tokens: int = SHARD_TOKENS,
    console: Console | None = None,
) -> dict:
    """Tokenize ``inputs`` into ``out`` (a new directory); returns the index written."""
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ShardingError(
            f"--out {out!r} already exists and is not empty; nothing was "
            "written. Fix: choose a new directory."
        )
    if not 0 <= eval_fraction < 1:
        raise ShardingError(f"--eval-fraction {eval_fraction} must be in [0, 1).")
    if not inputs:
        raise ShardingError("data prepare: no inputs. Fix: pass text, .jsonl or dataset paths.")
    tok = Tokenizer(tokenizer, eos)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.int32
    docs = list(read_documents(inputs))
    if not docs:
        raise ShardingError(f"data prepare: {', '.join(inputs)} hold no documents.")
    encoded = []
    with Progress(
        TextColumn("[bold]tokenize"),
        BarColumn(),
        MofNCompleteColumn(),
        console=console or Console(stderr=True),
        transient=True,
    ) as progress:
        task = progress.add_task("tokenize", total=len(docs))
        for doc in docs:
            ids, prompt = tok.encode(doc)
            if len(ids) - prompt < 1:
                raise ShardingError(
                    f"{doc.where}: the document has no tokens to learn from "
                    "(empty text or completion). Fix: drop it."
                )
            encoded.append((ids, prompt))
            progress.advance(task)
    n_eval = int(round(eval_fraction * len(docs)))
    n_eval = min(max(n_eval, 1 if eval_fraction > 0 else 0), len(docs) - 1)
    held = set(np.random.default_rng(seed).permutation(len(docs))[:n_eval].tolist())
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        splits = {
            "train": _write_split(
                tmp,
                "train",
                [e for i, e in enumerate(encoded) if i not in held],
                dtype,
                shard_tokens,
            ),
            "eval": _write_split(
                tmp, "eval", [e for i, e in enumerate(encoded) if i in held], dtype, shard_tokens
            ),
        }
        index = {
            "format": FORMAT,
            "dtype": np.dtype(dtype).name,
            "vocab_size": tok.vocab_size,
            "tokenizer": {"path": tok.path, "kind": tok.kind, "sha256": tok.sha256},
            "eos_id": tok.eos_id,
            "eval_fraction": eval_fraction,
            "seed": seed,
            "inputs": [str(Path(i)) for i in inputs],
            "splits": splits,
        }
        (tmp / INDEX).write_text(json.dumps(index, indent=1))
        if target.exists():
            target.rmdir()  # empty (checked above)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return index
