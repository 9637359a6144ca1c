"""The fine-tuning chain, end to end, on cpu-8-3d (data x fsdp x tensor = 2 x 2 x 2).

A tokenizer trained here -> prompt/completion JSON lines -> ``shardlib data prepare`` with a
held-out split -> tiny random Llamas made with ``transformers`` for that tokenizer's
vocabulary, imported (logits within 1e-5 of transformers') -> 20 steps of fine-tuning in which
only completion tokens carry loss (full: Llama 2 style; LoRA: Llama 3 style), evaluated on the
held-out split -> exported in Hugging Face format. The export is read back: its logits are
shardlib's, and its completion-only cross-entropy on the held-out documents is the run's
last eval loss, which ties the split, the prompt mask, evaluation and export together.

Two references: ``fixtures`` (default) starts from the models stored in ``fixtures/`` with
transformers' logits, and reads each export back with shardlib after checking it has the
fixture's tensor names, shapes and config (the import being transformers' function, proven
on the fixtures, the export is too). ``transformers`` (marker ``hf``) makes the models now
and loads each export in transformers itself.
"""

import json
import random
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from hf_models import FIXTURE_VOCAB, assert_like_fixture, fixture, hf_logits, make_hf, rel_err
from tokenizer_data import WORDS, lines, word_level

from shardlib.core.mesh import MeshSpec
from shardlib.dataset.index import Prepared
from shardlib.dataset.loader import packed_rows
from shardlib.interop.hf_io import flatten
from shardlib.parallel.plan import ParallelPlan
from shardlib.tools import cli
from shardlib.tools.generate import data_tokenizer
from shardlib.train.config import TrainConfig, override
from shardlib.train.init_from import load_model, max_abs_difference, with_source_model
from shardlib.train.loop import run
from shardlib.train.setup import make_setup

pytest.importorskip("tokenizers")
CUBE = MeshSpec((("data", 2), ("fsdp", 2), ("tensor", 2)))
SEQ, BATCH, STEPS, EVAL_EVERY, EVAL_BATCHES = 32, 8, 20, 5, 2


def write_prompts(path, n: int, seed: int) -> dict[str, int]:
    """Prompts of 2-4 uniform words; completions of 2-8 words, word i drawn with weight 2^-i
    (a distribution the model can learn in a few steps, unlike the prompts'). Returns each
    example's text -> its prompt's words (= tokens: the tokenizer is word level)."""
    rng = random.Random(seed)
    skew = [0.5**i for i in range(len(WORDS))]
    prompts = {}
    with open(path, "w") as f:
        for _ in range(n):
            prompt = rng.choices(WORDS, k=rng.randint(2, 4))
            completion = rng.choices(WORDS, skew, k=rng.randint(2, 8))
            prompts[" ".join(prompt + completion)] = len(prompt)
            f.write(json.dumps({"prompt": " ".join(prompt), "completion": " ".join(completion)}))
            f.write("\n")
    return prompts


def fine_tune(directory, data, mesh, out, **settings):
    """``STEPS`` steps from ``directory``'s weights on the prepared ``data``, evaluated every
    ``EVAL_EVERY`` steps on its held-out split; the setup and the run's result."""
    cfg = override(TrainConfig(), {
        "data": str(data), "steps": STEPS, "batch": BATCH, "seq": SEQ, "warmup": 1,
        "eval_every": EVAL_EVERY, "eval_batches": EVAL_BATCHES, "init_from": str(directory),
        "checkpoint_dir": str(out), "checkpoint_every": 0, **settings,
    })  # fmt: skip
    setup = make_setup(with_source_model(cfg), mesh)  # the model: directory/config.json
    result = run(setup, show=False)
    evals = [r["eval_loss"] for r in result.records if "eval_loss" in r]
    assert len(evals) == STEPS // EVAL_EVERY and evals[-1] < evals[0] - 0.1, evals
    losses = result.losses  # packed batches differ step to step: compare five-step means
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.1, losses
    return setup, result, evals


def imported(live: bool, style: str, directory, mesh, rules) -> tuple[Path, dict]:
    """A ``style`` Llama for the tokenizer's vocabulary - the fixture, or (``live``) one
    transformers makes now in ``directory`` - imported on ``mesh``: its logits must be
    transformers' (fp32, 1e-5). Its directory and parameters."""
    source, tokens, want = fixture(style)
    if live:
        source, want = directory, hf_logits(make_hf(style, directory, FIXTURE_VOCAB), tokens)
    model = load_model(source, mesh, rules)
    assert rel_err(jax.jit(lambda m, t: m(t))(model, tokens), want) < 1e-5
    return source, flatten(jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param))))


def exported(live: bool, style: str, directory, mesh, rules):
    """The reference reading an export: transformers (``live``), or shardlib after the export
    is checked to hold the fixture's tensor names, shapes and config. ``tokens -> logits``."""
    if live:
        return lambda tokens: hf_logits(directory, tokens)
    assert_like_fixture(directory, style, same_values=False)
    model = load_model(directory, mesh, rules)
    forward = jax.jit(lambda m, t: m(t))
    return lambda tokens: np.asarray(forward(model, np.asarray(tokens)))


def logits(setup, params, tokens):
    return jax.jit(lambda p, t: nnx.merge(setup.graphdef, p)(t))(params, tokens)


def held_out_loss(export_logits, data, prompts: dict) -> float:
    """The cross-entropy of an export (``export_logits``) over the targets evaluation counts: the
    completion tokens of the documents in the held-out split's first ``EVAL_BATCHES``
    batches, each document in a row of its own (packed rows keep attention inside a
    document; right padding changes no earlier logit of a causal model). ``prompts``: each
    document's text -> its prompt's token count."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(Prepared(data).index["tokenizer"]["path"])
    rows = iter(packed_rows([(Prepared(data), 1.0)], "eval", SEQ, BATCH, 0, shuffle=False))
    docs, weights = [], []  # [docs, SEQ + 1] inputs and targets, [docs, SEQ] target weights
    for _ in range(EVAL_BATCHES):
        batch = next(rows)
        for r in range(BATCH):
            for s in range(1, batch["segments"][r].max() + 1):
                cols = np.flatnonzero(batch["segments"][r] == s)
                doc = batch["tokens"][r, cols[0] : cols[-1] + 2]
                n = int(np.flatnonzero(doc == tok.token_to_id("</s>"))[0]) + 1  # its tokens
                w = batch["weights"][r, cols]  # counted: the completion's targets and </s>
                assert w.sum() == n - prompts[tok.decode(doc[: n - 1].tolist())]
                docs.append(np.pad(doc, (0, SEQ + 1 - len(doc))))
                weights.append(np.pad(w, (0, SEQ - len(cols))))
    docs_DL1, w_DL = np.stack(docs), np.stack(weights)
    z_DLV = export_logits(docs_DL1[:, :-1]).astype(np.float64)
    z_DLV -= z_DLV.max(-1, keepdims=True)
    logp_DLV = z_DLV - np.log(np.exp(z_DLV).sum(-1, keepdims=True))
    ce_DL = -np.take_along_axis(logp_DLV, docs_DL1[:, 1:, None], -1)[..., 0]
    return float((ce_DL * w_DL).sum() / w_DL.sum())


@pytest.mark.slow
@pytest.mark.parametrize("live", [False, pytest.param(True, marks=pytest.mark.hf)],
                         ids=["fixtures", "transformers"])  # fmt: skip
def test_prepare_fine_tune_evaluate_export(live, tmp_path, capsys):
    mesh, rules = CUBE.build(jax.devices()[:8]), ParallelPlan(mesh=CUBE).rules
    tok = word_level(tmp_path / "tokenizer.json", lines(200, 0))
    prompts = write_prompts(tmp_path / "sft.jsonl", 240, seed=1)
    data = tmp_path / "data"
    assert cli.main(["data", "prepare", str(tmp_path / "sft.jsonl"), "--tokenizer", tok,
                     "--out", str(data), "--eval-fraction", "0.1"]) == 0  # fmt: skip
    prepared = Prepared(data)
    assert prepared.documents("eval") == 24 and prepared.documents("train") == 216
    vocab = prepared.vocab_size  # the models are made for the tokenizer: 16 words, <unk>, </s>
    assert vocab == len(WORDS) + 2 == FIXTURE_VOCAB
    _, tokens, _ = fixture("llama2")

    # Llama 2 style, full fine-tuning
    full_dir, _ = imported(live, "llama2", tmp_path / "llama2", mesh, rules)
    setup, full, evals = fine_tune(full_dir, data, mesh, tmp_path / "full", lr=1e-2)
    assert cli.main(["export", "--checkpoint", str(tmp_path / "full"),
                     "--out", str(tmp_path / "full_hf"), "--format", "hf"]) == 0  # fmt: skip
    theirs = exported(live, "llama2", tmp_path / "full_hf", mesh, rules)
    assert rel_err(logits(setup, full.state["params"], tokens), theirs(tokens)) < 1e-5
    assert abs(held_out_loss(theirs, data, prompts) - evals[-1]) <= 1e-5 * evals[-1]

    # Llama 3 style, LoRA on every projection: only the adapters move; export merges them
    lora_dir, base = imported(live, "llama3", tmp_path / "llama3", mesh, rules)
    setup, lora, evals = fine_tune(lora_dir, data, mesh, tmp_path / "lora", lr=3e-2, **{
        "lora.rank": 4, "lora.alpha": 8.0, "lora.targets": "q,k,v,o,gate,up,down"})  # fmt: skip
    params = flatten(jax.device_get(lora.state["params"]))
    adapters = [p for p in params if "/lora_" in p]
    assert len(adapters) == 14 and set(params) == set(base) | set(adapters)
    assert max_abs_difference(params, base) == 0.0  # the base weights did not move
    assert all(np.abs(params[p]).max() > 0 for p in adapters if p.endswith("_b"))
    lora_ckpt = str(tmp_path / "lora")
    assert cli.main(["export", "--checkpoint", lora_ckpt, "--out", str(tmp_path / "lora_hf"),
                     "--format", "hf"]) == 0  # fmt: skip
    theirs = exported(live, "llama3", tmp_path / "lora_hf", mesh, rules)
    assert rel_err(logits(setup, lora.state["params"], tokens), theirs(tokens)) < 1e-5
    assert abs(held_out_loss(theirs, data, prompts) - evals[-1]) <= 1e-5 * evals[-1]

    capsys.readouterr()  # generation, by default with the tokenizer the data was prepared with
    generate = ["generate", "--checkpoint", lora_ckpt, "--prompt", "the cat"]
    assert cli.main([*generate, "--max-new-tokens", "4"]) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("the cat ") and "4 new tokens x 1" in printed.err
    assert set(printed.out.split()) <= set(WORDS) | {"</s>"}
    assert f"tokenizer {tok}" in " ".join(printed.err.split())
    assert data_tokenizer(lora_ckpt) == Path(tok)
    Path(tok).write_text(Path(tok).read_text() + " ")  # changed since: not taken for the data's
    assert data_tokenizer(lora_ckpt) is None
    generate += ["--tokenizer", tok]
    assert cli.main([*generate, "--max-new-tokens", "63"]) == 2  # 2 + 63 > 64 positions
    assert "more than the model's context of 64" in capsys.readouterr().err

    # parameters only, from a shardlib checkpoint: step 0, fresh optimizer, the same weights
    cfg = override(setup.cfg, {"init_from": lora_ckpt, "checkpoint_dir": None})
    state = make_setup(cfg, mesh).init_state()
    assert int(state["step"]) == 0
    assert max_abs_difference(state["params"], lora.state["params"]) == 0.0
    assert all(float(np.abs(m).max()) == 0.0 for m in jax.tree.leaves(state["opt_state"])
               if hasattr(m, "shape") and m.ndim > 0)  # fmt: skip
