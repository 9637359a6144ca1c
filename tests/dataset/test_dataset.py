"""Prepared datasets: prepare, grain loading, packing, prompt masks, mixtures, resume, errors.

Every tokenizer is trained here on a few lines (``tokenizers``' WordLevel trainer): nothing
is downloaded. Compiled programs are a 1-layer model on at most 2 devices.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from tokenizer_data import lines, word_level

from shardlib.core.errors import ShardingError
from shardlib.core.layout import use_layout
from shardlib.core.mesh import MeshSpec
from shardlib.dataset.index import Prepared
from shardlib.dataset.loader import PreparedData, documents, packed_rows
from shardlib.dataset.prepare import prepare
from shardlib.train.config import train_config
from shardlib.train.loop import run
from shardlib.train.setup import make_setup
from shardlib.train.step import accumulate_grads, make_loss_fn, normalise_weights

tokenizers = pytest.importorskip("tokenizers")
SEQ = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A trained tokenizer, a prompt/completion set and a plain-text set, prepared."""
    root = tmp_path_factory.mktemp("data")
    tok = word_level(root / "tok.json", lines(200, 0))
    sft = root / "sft.jsonl"
    with open(sft, "w") as f:
        for line in lines(80, 1):
            w = line.split()
            f.write(json.dumps({"prompt": " ".join(w[:2]), "completion": " ".join(w[2:])}) + "\n")
    text = root / "a.txt"
    text.write_text(" ".join(lines(30, 2, longest=8)))  # one document longer than a row
    plain = root / "plain.jsonl"
    plain.write_text("".join(json.dumps({"text": t}) + "\n" for t in lines(60, 3)))
    prepare([str(sft)], tok, str(root / "sft"), eval_fraction=0.1)
    prepare([str(text), str(plain)], tok, str(root / "plain"), eval_fraction=0.2, seed=1)
    return {
        "root": root,
        "tok": tok,
        "sft": str(root / "sft"),
        "plain": str(root / "plain"),
        "sft_jsonl": sft,
        "text": text,
        "plain_jsonl": plain,
    }


def _docs(path: str, split: str) -> list[list[int]]:
    data = Prepared(path)
    out = []
    for i, shard in enumerate(data.shards(split)):
        off = shard["offsets"]
        out += [data.read(split, i, a, b - a).tolist() for a, b in zip(off, off[1:], strict=False)]
    return out


def test_prepare_round_trip_and_held_out_split(corpus):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(corpus["tok"])
    eos = tok.token_to_id("</s>")
    index = json.loads((corpus["root"] / "plain" / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["eos_id"] == eos
    assert index["vocab_size"] == tok.get_vocab_size()
    texts = [corpus["text"].read_text()]
    texts += [json.loads(line)["text"] for line in corpus["plain_jsonl"].read_text().splitlines()]
    want = sorted(tok.encode(t).ids + [eos] for t in texts)
    train, held = _docs(corpus["plain"], "train"), _docs(corpus["plain"], "eval")
    assert sorted(train + held) == want  # every document once, in one split only
    assert len(held) == round(0.2 * len(texts))
    assert index["splits"]["train"]["shards"][0]["prompt_tokens"] is None
    # prompt/completion: the prompt's tokens are recorded so that they carry no loss
    sft = json.loads((corpus["root"] / "sft" / "index.json").read_text())
    shard = sft["splits"]["train"]["shards"][0]
    records = [json.loads(x) for x in corpus["sft_jsonl"].read_text().splitlines()]
    prompts = sorted(len(tok.encode(r["prompt"]).ids) for r in records)
    assert len(shard["prompt_tokens"]) == sft["splits"]["train"]["documents"] == 72
    assert set(shard["prompt_tokens"]) <= set(prompts) and min(shard["prompt_tokens"]) == 2


def test_int32_above_65536_ids(tmp_path):
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 70_000)}}
    tok = word_level(tmp_path / "big.json", vocab=vocab)
    (tmp_path / "in.txt").write_text("w3 w65535 w65536 w69999")
    index = prepare([str(tmp_path / "in.txt")], tok, str(tmp_path / "out"), eval_fraction=0)
    assert index["dtype"] == "int32" and index["vocab_size"] == 70_000
    assert (tmp_path / "out" / "train-00000.bin").stat().st_size == 4 * 4
    assert _docs(str(tmp_path / "out"), "train") == [[3, 65535, 65536, 69999]]


def test_sentencepiece_model_and_hf_dataset_input(corpus, tmp_path):
    spm = pytest.importorskip("sentencepiece")
    (tmp_path / "lines.txt").write_text("\n".join(lines(100, 4)))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "lines.txt"), model_prefix=str(tmp_path / "sp"), vocab_size=19,
        model_type="word", minloglevel=2,
    )  # fmt: skip
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    index = prepare([str(corpus["plain_jsonl"])], str(tmp_path / "sp.model"), str(tmp_path / "o"))
    assert index["tokenizer"]["kind"] == "sentencepiece" and index["eos_id"] == sp.eos_id()
    texts = [json.loads(x)["text"] for x in corpus["plain_jsonl"].read_text().splitlines()]
    docs = _docs(str(tmp_path / "o"), "train") + _docs(str(tmp_path / "o"), "eval")
    assert sorted(sp.decode(d[:-1]) for d in docs) == sorted(texts)
    assert all(d[-1] == sp.eos_id() for d in docs)
    # a saved Hugging Face dataset: read when `datasets` is installed, else a clear error
    (tmp_path / "hf").mkdir()
    try:
        import datasets
    except ImportError:
        with pytest.raises(ShardingError, match="pip install datasets"):
            prepare([str(tmp_path / "hf")], corpus["tok"], str(tmp_path / "o2"))
        return
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hf2"))
    prepare([str(tmp_path / "hf2")], corpus["tok"], str(tmp_path / "o2"), eval_fraction=0)
    assert Prepared(tmp_path / "o2").documents("train") == len(texts)


def test_prompt_mask_and_packing_keep_documents_apart(corpus):
    data = PreparedData.open(corpus["sft"], "", seq=SEQ, batch=4, seed=0, vocab=256)
    items = documents(data.sets, "train", SEQ, 0)
    first = items[0]
    prompt = int(np.argmax(first["weights"] > 0))
    assert prompt == 2 and not first["weights"][:prompt].any() and first["weights"][2:].all()
    rows = next(iter(packed_rows(data.sets, "train", SEQ, 4, 0)))
    seg, pos, w = rows["segments"], rows["positions"], rows["weights"]
    assert rows["tokens"].shape == (4, SEQ + 1) and seg.shape == pos.shape == w.shape == (4, SEQ)
    assert seg.max() >= 2  # documents share rows
    counted = 0
    for r in range(4):
        for s in range(1, seg[r].max() + 1):
            cols = np.flatnonzero(seg[r] == s)
            assert (pos[r, cols] == np.arange(len(cols))).all()  # positions restart per doc
            # targets counted: the completion only (the prompt's 2 tokens predict nothing)
            counted += int(w[r, cols].sum())
            assert not w[r, cols[:1]].any()
    assert counted == int(w.sum()) and not w[seg == 0].any()


def test_text_beside_prompt_completion_is_cut_not_refused(corpus, tmp_path):
    """One dataset from a text file and prompt/completion lines (the README's `prepare
    notes.txt chats.jsonl`): the long text document is cut into rows, the examples keep
    their prompts, and only an example longer than a row is refused."""
    prepare([str(corpus["text"]), str(corpus["sft_jsonl"])], corpus["tok"], str(tmp_path / "m"))
    data = Prepared(tmp_path / "m")
    (shard,) = data.shards("train")
    lengths = np.diff(shard["offsets"])
    assert shard["prompt_tokens"][0] == 0 and lengths[0] > SEQ + 1  # the text file, first
    pieces = data.pieces("train", SEQ)
    cut = -(-(lengths[0] - 1) // SEQ)  # rows overlapping by one token
    assert (pieces.prompt[:cut] == 0).all() and pieces.length[:cut].max() == SEQ + 1
    assert list(pieces.prompt[cut:]) == shard["prompt_tokens"][1:]  # each example whole
    with pytest.raises(ShardingError, match=r"train document \d+ of train-00000.bin \(prompt 2"):
        data.pieces("train", 8)


@pytest.fixture(scope="module")
def one_device(corpus):
    """A 1-layer model on one device and its parameters (initialised eagerly: no compile)."""
    cfg = train_config(data=corpus["sft"], batch=4, seq=SEQ, steps=2, **{"model.layers": 1})
    setup = make_setup(cfg, MeshSpec((("data", 1),)).build(jax.devices()[:1]))
    with nnx.use_eager_sharding(False):
        model = setup.model.make(nnx.Rngs(params=0))
    return setup, nnx.to_pure_dict(nnx.state(model, nnx.Param))


def test_packed_loss_is_the_token_weighted_loss_of_its_documents(corpus, one_device):
    """Packed rows: loss = sum over documents of (weighted token losses) / sum of weights,
    the same as each document run alone; micro-batches keep that global normalisation."""
    setup, params = one_device
    sets = PreparedData.open(corpus["sft"], "", seq=SEQ, batch=4, seed=0, vocab=256).sets
    rows = next(iter(packed_rows(sets, "train", SEQ, 4, 0)))
    batch = {k: jnp.asarray(v) for k, v in rows.items()}
    loss_fn = make_loss_fn(setup)
    packed = float(jax.jit(loss_fn)(params, normalise_weights(batch)))
    # every document alone, right-padded (causal: padding after it changes nothing)
    alone, weights = [], []
    for r in range(4):
        for s in range(1, rows["segments"][r].max() + 1):
            cols = np.flatnonzero(rows["segments"][r] == s)
            doc = rows["tokens"][r, cols[0] : cols[-1] + 2]  # inputs and their targets
            alone.append(np.pad(doc, (0, SEQ + 1 - len(doc))))
            weights.append(np.pad(rows["weights"][r, cols], (0, SEQ - len(cols))))
    docs_DL1, w_DL = np.stack(alone), np.stack(weights)

    @jax.jit
    def token_losses(p, tokens_DL1):  # [docs, seq]: plain causal attention, positions 0..
        logits = nnx.merge(setup.graphdef, p)(tokens_DL1[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens_DL1[:, 1:])

    ce_DL = np.asarray(token_losses(params, docs_DL1))
    reference = float((ce_DL * w_DL).sum() / w_DL.sum())
    assert len(alone) > 4 and abs(packed - reference) <= 1e-5 * abs(reference)
    # two micro-batches carrying different token weights: still the one global masked mean
    w = rows["weights"]
    assert w[0::2].sum() != w[1::2].sum()
    loss2, _ = jax.jit(
        lambda p, b: accumulate_grads(loss_fn, p, normalise_weights(b), 2, setup.grad_shardings)
    )(params, batch)
    assert abs(float(loss2) - reference) <= 1e-5 * abs(reference)


@pytest.mark.slow
def test_packed_batch_parity_on_data_fsdp_tensor(corpus, one_device):
    """data x fsdp x tensor (rows and heads split) gives one device's loss and gradients."""
    setup, params = one_device
    sets = PreparedData.open(corpus["sft"], "", seq=SEQ, batch=4, seed=0, vocab=256).sets
    batch = {
        k: jnp.asarray(v) for k, v in next(iter(packed_rows(sets, "train", SEQ, 4, 0))).items()
    }
    loss_fn = make_loss_fn(setup)
    loss1, grads = jax.jit(jax.value_and_grad(loss_fn))(params, normalise_weights(batch))
    reference = float(loss1)
    cube = make_setup(setup.cfg, MeshSpec((("data", 2), ("fsdp", 2), ("tensor", 2))).build())

    def cube_grads(p, b):
        with use_layout(cube.mesh, cube.rules):
            return jax.value_and_grad(make_loss_fn(cube))(p, normalise_weights(b))

    shard = jax.jit(cube_grads, in_shardings=(cube.param_shardings, cube.batch_sharding))
    loss8, grads8 = shard(params, batch)
    assert abs(float(loss8) - reference) <= 1e-5 * abs(reference)
    one, eight = jax.device_get((jax.tree.leaves(grads), jax.tree.leaves(grads8)))
    for g1, g8 in zip(one, eight, strict=True):
        assert np.linalg.norm(g8 - g1) <= 1e-5 * np.linalg.norm(g1) + 1e-12


def test_embedded_corpus_evaluation_is_held_out(one_device):
    from shardlib.dataset.tokens import DEFAULT_CORPUS_BYTES, FlatData, embedded_corpus
    from shardlib.train.step import build_eval_step

    setup, params = one_device
    train, held = embedded_corpus(), embedded_corpus(DEFAULT_CORPUS_BYTES + (512 << 10))
    assert np.array_equal(held[: train.size], train)  # training bytes unchanged, eval after
    flat = FlatData(train, None, batch=4, seq=SEQ, seed=0)
    (batch,) = flat.eval_batches(1, setup.batch_sharding)
    assert np.isin(np.asarray(batch), held[train.size :]).all()
    loss, weight = build_eval_step(setup)(params, batch)
    assert float(weight) == 4 * SEQ
    assert abs(float(loss) - float(jax.jit(make_loss_fn(setup))(params, batch))) < 1e-6
    with pytest.raises(ShardingError, match="no held-out part"):
        FlatData(train, "tokens.bin", batch=4, seq=SEQ, seed=0).eval_batches(1, None)


def test_each_process_reads_its_own_slice(corpus, monkeypatch):
    from shardlib.dataset import loader

    sets = [(Prepared(corpus["plain"]), 1.0)]
    whole = loader.documents(sets, "train", SEQ, 0)
    monkeypatch.setattr(loader.jax, "process_count", lambda: 2)
    for rank in (0, 1):
        monkeypatch.setattr(loader.jax, "process_index", lambda r=rank: r)
        mine = loader.documents(sets, "train", SEQ, 0)
        assert all(np.array_equal(mine[i]["tokens"], whole[2 * i + rank]["tokens"])
                   for i in range(20))  # fmt: skip


def test_mixture_follows_its_weights(corpus):
    sets = [(Prepared(corpus["sft"]), 3.0), (Prepared(corpus["plain"]), 1.0)]
    stream = documents(sets, "train", SEQ, 0)
    sources = [stream[i]["source"] for i in range(400)]
    assert sources.count(0) == 300 and sources.count(1) == 100
    again = documents(sets, "train", SEQ, 0)
    assert all(np.array_equal(stream[i]["tokens"], again[i]["tokens"]) for i in range(50))
    other = documents(sets, "train", SEQ, 1)  # another seed, another order
    assert any(not np.array_equal(stream[i]["tokens"], other[i]["tokens"]) for i in range(50))


@pytest.mark.slow  # the fast subset keeps the inner loop under 3 minutes
def test_kill_and_resume_on_a_prepared_mixture_is_bitwise(corpus, tmp_path):
    mix = f"{corpus['sft']}:0.5,{corpus['plain']}:0.5"
    mesh = MeshSpec((("data", 2),)).build(jax.devices()[:2])
    common = dict(batch=4, seq=SEQ, steps=6, data__mix=mix, eval_every=3, eval_batches=2)
    common["model.layers"] = 1
    whole = run(make_setup(train_config(**common), mesh), show=False)
    resumable = make_setup(train_config(**common, checkpoint_dir=str(tmp_path / "ck")), mesh)
    first = run(resumable, show=False, stop_after=3)
    meta = json.loads((tmp_path / "ck" / "3" / "meta" / "metadata").read_text())
    assert meta["data"]["identity"]["loader"]["processes"][0]["parent"]["next_index"] > 0
    rest = run(resumable, show=False)
    assert first.losses + rest.losses == whole.losses  # bitwise: the same batches
    evals = [r["eval_loss"] for r in whole.records if "eval_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0]  # held-out loss falls
    assert rest.records[-1]["eval_loss"] == whole.records[-1]["eval_loss"]
    assert whole.records[-1]["eval_perplexity"] == pytest.approx(np.exp(evals[1]))


def test_bad_data_is_refused_before_any_work(corpus, tmp_path):
    # an output that exists is left as it was
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(ShardingError, match="already exists"):
        prepare([str(corpus["text"])], corpus["tok"], str(out))
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    # a malformed line names its file and line, and nothing is written
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "the cat"}\n{"prompt": 3}\n')
    with pytest.raises(ShardingError, match=r"bad.jsonl:2: .*prompt"):
        prepare([str(bad)], corpus["tok"], str(tmp_path / "new"))
    assert not (tmp_path / "new").exists() and len(list(tmp_path.iterdir())) == 2
    # a tokenizer larger than the model's vocabulary
    with pytest.raises(ShardingError, match="model.vocab=18"):
        PreparedData.open(corpus["sft"], "", seq=SEQ, batch=4, seed=0, vocab=16)
    # a prompt/completion example longer than a row
    with pytest.raises(ShardingError, match=r"longer than a row of seq \+ 1 = 9 .*Fix"):
        PreparedData.open(corpus["sft"], "", seq=8, batch=4, seed=0, vocab=256)
    # a corrupt shard (same size, other bytes) is named
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(corpus["plain"], copy)
    shard = copy / "train-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(ShardingError, match=r"train-00000.bin is corrupt"):
        Prepared(copy)
    # ... and refused by a run before its checkpoint directory is created
    cfg = train_config(data=str(copy), batch=4, seq=SEQ, checkpoint_dir=str(tmp_path / "ck"))
    setup = make_setup(cfg, MeshSpec((("data", 1),)).build(jax.devices()[:1]))
    with pytest.raises(ShardingError, match=r"train-00000.bin is corrupt"):
        run(setup, show=False)
    assert not (tmp_path / "ck").exists()


def test_cli_prepares_and_refuses_a_pipeline_for_packed_rows(corpus, tmp_path, capsys):
    from shardlib.tools.cli import main

    out = tmp_path / "cli"
    args = ["data", "prepare", str(corpus["plain_jsonl"]), "--tokenizer", corpus["tok"]]
    assert main([*args, "--out", str(out), "--eval-fraction", "0.1"]) == 0
    said = " ".join(capsys.readouterr().err.split())  # rich wraps lines
    assert "54 train documents" in said and Prepared(out).documents("eval") == 6
    assert main([*args, "--out", str(out)]) == 2  # exists: refused, one line, no traceback
    err = capsys.readouterr().err
    assert "already exists" in err and "Traceback" not in err
    train = ["train", "--mesh", "cpu-8-pipeline", f"data={out}", "steps=1", "seq=16", "batch=8"]
    assert main(train) == 2
    assert "pipeline schedule" in " ".join(capsys.readouterr().err.split())


def test_tensorboard_puts_held_out_figures_under_eval(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from shardlib.train.metrics import TensorBoard

    board = TensorBoard(str(tmp_path))
    board.write({"step": 3, "loss": 2.0, "eval_loss": 1.5, "eval_perplexity": 4.48})
    board.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"train/loss", "eval/loss", "eval/perplexity"}
