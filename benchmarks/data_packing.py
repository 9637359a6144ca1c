"""Packed rows against their documents alone, micro-batches, and data x fsdp x tensor parity.

    python benchmarks/data_packing.py

Prepares 80 prompt/completion examples (a word-level tokenizer trained here), packs four
rows of 33 tokens and prints: the packed batch's masked-mean loss next to the token-weighted
loss of each document run alone (plain causal attention), what a mean of per-document means
would give instead, the loss with two micro-batches, and loss and gradients on
data=2 x fsdp=2 x tensor=2 (8 simulated CPU devices) against one device.
"""

import json
import os
import tempfile

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from shardlib.core.layout import use_layout
from shardlib.core.mesh import MeshSpec
from shardlib.dataset.loader import PreparedData, packed_rows
from shardlib.dataset.prepare import prepare
from shardlib.train.config import train_config
from shardlib.train.setup import make_setup
from shardlib.train.step import accumulate_grads, make_loss_fn, normalise_weights

WORDS = "the cat sat on a mat dog ran far away quick brown fox jumps over lazy".split()


def lines(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 21))) for _ in range(n)]


def word_level(path: Path, corpus: list[str]) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"]))
    tok.save(str(path))
    return str(path)


def rel(a: float, b: float) -> str:
    return f"{abs(a - b) / abs(b):.1e}"


def main() -> None:
    root = Path(tempfile.mkdtemp())
    seq = 32
    tok = word_level(root / "tok.json", lines(200, 0))
    with open(root / "sft.jsonl", "w") as f:
        for line in lines(80, 1):
            w = line.split()
            pair = {"prompt": " ".join(w[:2]), "completion": " ".join(w[2:])}
            f.write(json.dumps(pair) + "\n")
    prepare([str(root / "sft.jsonl")], tok, str(root / "sft"), eval_fraction=0.1)
    cfg = train_config(data=str(root / "sft"), batch=4, seq=seq, steps=2, **{"model.layers": 1})
    setup = make_setup(cfg, MeshSpec((("data", 1),)).build(jax.devices()[:1]))
    params = jax.device_get(setup.init_state()["params"])
    sets = PreparedData.open(str(root / "sft"), "", seq=seq, batch=4, seed=0, vocab=256).sets
    rows = next(iter(packed_rows(sets, "train", seq, 4, 0)))
    batch = {k: jnp.asarray(v) for k, v in rows.items()}
    loss_fn = make_loss_fn(setup)
    packed = float(jax.jit(loss_fn)(params, normalise_weights(batch)))
    alone, weights = [], []  # each document right-padded: causal, so padding changes nothing
    for r in range(4):
        for s in range(1, rows["segments"][r].max() + 1):
            cols = np.flatnonzero(rows["segments"][r] == s)
            doc = rows["tokens"][r, cols[0] : cols[-1] + 2]
            alone.append(np.pad(doc, (0, seq + 1 - len(doc))))
            weights.append(np.pad(rows["weights"][r, cols], (0, seq - len(cols))))
    docs_DL1, w_DL = np.stack(alone), np.stack(weights)
    logits = jax.jit(lambda p, t: nnx.merge(setup.graphdef, p)(t))(params, docs_DL1[:, :-1])
    ce_DL = np.asarray(optax.softmax_cross_entropy_with_integer_labels(logits, docs_DL1[:, 1:]))
    ref = float((ce_DL * w_DL).sum() / w_DL.sum())
    mean_of_means = float(np.mean((ce_DL * w_DL).sum(1) / w_DL.sum(1)))
    loss2, grads2 = jax.jit(
        lambda p, b: accumulate_grads(loss_fn, p, normalise_weights(b), 2, setup.grad_shardings)
    )(params, batch)
    cube = make_setup(cfg, MeshSpec((("data", 2), ("fsdp", 2), ("tensor", 2))).build())

    def cube_grads(p, b):
        with use_layout(cube.mesh, cube.rules):
            return jax.value_and_grad(make_loss_fn(cube))(p, normalise_weights(b))

    shard = jax.jit(cube_grads, in_shardings=(cube.param_shardings, cube.batch_sharding))
    loss8, grads8 = shard(params, batch)
    one, eight = jax.device_get((jax.tree.leaves(grads2), jax.tree.leaves(grads8)))
    gerr = max(np.linalg.norm(x - y) / np.linalg.norm(x) for x, y in zip(one, eight, strict=True))
    print(f"{len(docs_DL1)} documents in 4 rows of {seq + 1}; {w_DL.sum():.0f} tokens carry loss")
    print(f"packed loss           {packed:.7f}  rel err {rel(packed, ref)}")
    print(f"documents alone       {ref:.7f}  (sum of weighted token losses / sum of weights)")
    print(f"mean of doc means     {mean_of_means:.7f}  differs by {rel(mean_of_means, ref)}")
    print(f"2 micro-batches       {float(loss2):.7f}  rel err {rel(float(loss2), ref)}")
    print(
        f"data2 x fsdp2 x tp2   {float(loss8):.7f}  rel err {rel(float(loss8), ref)}, "
        f"gradients max rel err {gerr:.1e} (vs one device, 2 micro-batches)"
    )


if __name__ == "__main__":
    main()
