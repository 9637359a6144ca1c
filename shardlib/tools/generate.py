"""Text generation with a KV cache on a mesh: a jitted prefill, then a jitted decode step.

The model follows the ``Generator`` protocol (``shardlib.core.model``: ``init_cache``,
``decode``, ``max_positions``; ``models.llama.cache`` implements it); here the cache is laid
out on the mesh by the activation rules of ``CACHE_NAMES`` (the batch over the data axes, kv
heads over ``tensor``), the parameters keep their training layout, and sampling is greedy
(temperature 0), temperature or top-k.
Generation stops at ``max_new_tokens`` or when every sequence has produced ``eos``.
Tokens are bytes by default (the embedded corpus' vocabulary); a ``tokenizers``
``tokenizer.json`` gives any other vocabulary: given, in a Hugging Face directory, or the one
a checkpoint's run prepared its data with.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from shardlib.core.capabilities import Generator
from shardlib.core.errors import ShardingError
from shardlib.core.layout import mesh_axes
from shardlib.core.rules import Rules

CACHE_NAMES = (None, "batch", None, "kv_heads", "head_dim")
"""A cache buffer [layers, batch, length, kv_heads, head_dim]: its dims' logical names."""


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 64
    """Token budget after the prompt."""
    temperature: float = 0.0
    """0: greedy (argmax); > 0: sample from softmax(logits / temperature)."""
    top_k: int = 0
    """Sample only among the k most likely tokens (0: all)."""
    seed: int = 0
    eos: int | None = None
    """Stop a sequence at this token (None: only the budget stops)."""


@dataclass(frozen=True)
class Generated:
    tokens: np.ndarray
    """[batch, prompt + new] token ids (after eos: eos repeated)."""
    prompt_len: int
    prefill_s: float
    """The prompt's forward pass, its compilation included."""
    first_decode_s: float
    """The first decode step, its compilation included (0 when none ran)."""
    decode_s: float
    """Every later decode step together."""
    new_tokens: int


def cache_sharding(mesh: Mesh, rules: Rules, batch: int, kv_heads: int = 0) -> NamedSharding:
    """The cache's layout; the batch stays whole when it does not divide over its axes, and
    ``kv_heads`` fewer than the tensor degree are replicated, as the attention's K/V are."""
    axes = mesh_axes(mesh)
    if kv_heads:
        rules = rules.for_sizes({"kv_heads": kv_heads}, axes)
    spec = list(rules.spec(CACHE_NAMES, "activations"))
    batch_axes = spec[1] if isinstance(spec[1], tuple) else (spec[1],) if spec[1] else ()
    if batch % int(np.prod([axes[a] for a in batch_axes] or [1])):
        spec[1] = None
    return NamedSharding(mesh, P(*spec))


def pick(logits_BV, key, temperature: float, top_k: int):
    """The next token [batch] from the last position's logits."""
    if temperature <= 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits_BV = logits_BV / temperature
    if top_k:
        kth_B1 = jax.lax.top_k(logits_BV, top_k)[0][:, -1:]
        logits_BV = jnp.where(logits_BV < kth_B1, -jnp.inf, logits_BV)
    return jax.random.categorical(key, logits_BV, axis=-1).astype(jnp.int32)


def generate(model, prompt_BP, *, mesh: Mesh, rules: Rules, sampling: Sampling) -> Generated:
    """Continue every row of ``prompt_BP`` (token ids, equal lengths) on ``mesh``."""
    if not isinstance(model, Generator):
        raise ShardingError(
            f"generate: {type(model).__name__} has no KV-cache path (the Generator protocol of "
            "shardlib.core.model: init_cache, decode, max_positions). Fix: generate with a "
            "model that implements it, such as a llama preset."
        )
    prompt_BP = np.asarray(prompt_BP, dtype=np.int32)
    b, p = prompt_BP.shape
    limit = model.max_positions
    total = p + sampling.max_new_tokens
    if p < 1:
        raise ShardingError("generate: the prompt is empty. Fix: give at least one token.")
    if total > limit:
        raise ShardingError(
            f"generate: the prompt has {p} tokens and {sampling.max_new_tokens} new ones are "
            f"asked for: {total} positions, more than the model's context of {limit} "
            "(model.max_positions). Fix: a shorter prompt or a smaller --max-new-tokens."
        )
    graphdef, params = nnx.split(model)
    kv_heads = jax.tree.leaves(jax.eval_shape(lambda: model.init_cache(b, total)))[0].shape[3]
    sharding = cache_sharding(mesh, rules, b, kv_heads)
    cache = jax.jit(lambda: model.init_cache(b, total), out_shardings=sharding)()
    temperature, top_k = sampling.temperature, sampling.top_k

    @partial(jax.jit, donate_argnums=2)
    def step(params, tokens_BT, cache, start, key):
        logits_BTV, cache = nnx.merge(graphdef, params).decode(tokens_BT, cache, start)
        return pick(logits_BTV[:, -1], key, temperature, top_k), cache

    keys = jax.random.split(jax.random.key(sampling.seed), sampling.max_new_tokens)
    out = [prompt_BP]
    done = np.zeros(b, bool)
    t0 = time.perf_counter()
    with jax.set_mesh(mesh):
        token_B, cache = step(params, jnp.asarray(prompt_BP), cache, jnp.int32(0), keys[0])
        token_B = np.asarray(token_B)
        prefill_s, t1, first_s = time.perf_counter() - t0, time.perf_counter(), 0.0
        for i in range(sampling.max_new_tokens):
            if sampling.eos is not None:
                token_B = np.where(done, sampling.eos, token_B)
                done |= token_B == sampling.eos
            out.append(token_B[:, None])
            if done.all() or i + 1 == sampling.max_new_tokens:
                break
            token_B, cache = step(
                params, jnp.asarray(token_B[:, None]), cache, jnp.int32(p + i), keys[i + 1]
            )
            token_B = np.asarray(token_B)
            if i == 0:
                first_s, t1 = time.perf_counter() - t1, time.perf_counter()
    tokens = np.concatenate(out, axis=1)
    later_s = time.perf_counter() - t1 if first_s else 0.0
    return Generated(tokens, p, prefill_s, first_s, later_s, tokens.shape[1] - p)


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: the embedded corpus' vocabulary."""

    vocab = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


class FileTokenizer:
    """A ``tokenizers`` ``tokenizer.json`` (Hugging Face's fast tokenizers)."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        self.path = str(path)
        self._tok = Tokenizer.from_file(self.path)
        self.vocab = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def data_tokenizer(checkpoint: str | Path) -> Path | None:
    """The tokenizer.json a run's prepared data was tokenized with (``dataset=``, or the first
    set of ``dataset.mix``), if it is still where ``shardlib data prepare`` read it and unchanged
    (its SHA-256 is in the data's index); None for the embedded corpus or a token file."""
    import json

    from shardlib.checkpoint.store import read_meta
    from shardlib.dataset.index import INDEX, file_sha256
    from shardlib.dataset.loader import parse_mix

    _, meta = read_meta(Path(checkpoint).absolute())
    config = meta["config"]  # runs recorded before the section was renamed call it "data"
    data = config.get("dataset") or config.get("data", {})
    where = parse_mix(data.get("path"), data.get("mix", ""))[0][0]
    index = Path(where or "") / INDEX
    if not where or not index.is_file():
        return None
    tok = json.loads(index.read_text()).get("tokenizer", {})
    path = Path(tok.get("path", ""))
    if tok.get("kind") != "tokenizers" or not path.is_file() or file_sha256(path) != tok["sha256"]:
        return None
    return path


def tokenizer_for(path, source, vocab: int, checkpoint: str | Path | None = None):
    """``path``, else ``source``/tokenizer.json (a Hugging Face directory), else the one the
    ``checkpoint``'s run prepared its data with (``data_tokenizer``), else bytes."""
    if path is None and source is not None and (Path(source) / "tokenizer.json").is_file():
        path = Path(source) / "tokenizer.json"
    if path is None and checkpoint is not None:
        path = data_tokenizer(checkpoint)
    tok = FileTokenizer(path) if path else ByteTokenizer()
    if tok.vocab > vocab:
        raise ShardingError(
            f"generate: the tokenizer has {tok.vocab} tokens but the model's vocabulary is "
            f"{vocab}. Fix: --tokenizer with the model's own tokenizer.json."
        )
    return tok


def generate_command(args, console, mesh: Mesh, cfg) -> int:
    """``shardlib generate``: load a checkpoint or Hugging Face directory, continue the
    prompt, print the text on stdout and the timings on stderr."""
    from shardlib.train.init_from import load_model

    rules = cfg.parallel.with_mesh_axes(mesh_axes(mesh)).rules
    source = args.checkpoint or args.hf
    model = load_model(source, mesh, rules)
    tok = tokenizer_for(args.tokenizer, args.hf, model.cfg.vocab, args.checkpoint)
    if hasattr(tok, "path"):
        console.print(f"tokenizer {tok.path}", soft_wrap=True)  # a path stays whole
    prompt = [tok.encode(args.prompt)] * args.samples
    sampling = Sampling(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        seed=args.seed, eos=args.eos,
    )  # fmt: skip
    out = generate(model, prompt, mesh=mesh, rules=rules, sampling=sampling)
    for row in out.tokens:
        print(tok.decode(row))  # the text on stdout, the timings on stderr
    per_token = out.decode_s / max(out.new_tokens - 2, 1)  # steps after the first
    console.print(
        f"{out.new_tokens} new tokens x {args.samples}: prefill {out.prefill_s:.2f} s and first "
        f"decode step {out.first_decode_s:.2f} s (each compiled), then "
        f"{per_token * 1e3:.1f} ms per decode step"
    )
    return 0
