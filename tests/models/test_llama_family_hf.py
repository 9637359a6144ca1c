"""The Llama-shaped families beyond Llama in Hugging Face's form: Qwen2 (q/k/v biases,
``models/qwen2``), Mistral (sliding-window attention, ``models/mistral``), Mixtral (experts
and router, ``models/moe/hf.py``) and Llama's RoPE scalings linear, dynamic NTK and YaRN
(``models/llama/rotary.py``).

Each is a tiny random model made by ``transformers`` and stored with the logits it
computed (``hf_models.FAMILIES``, ``interop/fixtures/``): imported on cpu-8-3d (data x fsdp x
tensor = 2 x 2 x 2) its logits must be transformers' within 1e-5 (fp32), and exported again
it must be transformers' tensors bit for bit with an agreeing ``config.json``. Then greedy
generation with the KV cache (biases, the window and the scaled angles on the cache path)
equals the argmax of full forward passes, and one fine-tuning step on a prepared dataset
runs per family and exports. Marker ``hf``: transformers itself loads each export.
"""

import json

import jax
import numpy as np
import pytest
from flax import nnx
from hf_models import FAMILIES, FIXTURE_VOCAB, assert_like_fixture, fixture, hf_logits, rel_err

from shardlib.core.mesh import MeshSpec
from shardlib.interop.hf import adapter_for, model_settings, read_config
from shardlib.interop.hf_io import export_hf, flatten
from shardlib.parallel.plan import ParallelPlan
from shardlib.tools import cli
from shardlib.tools.generate import Sampling, generate
from shardlib.train.init_from import load_model

CUBE = MeshSpec((("data", 2), ("fsdp", 2), ("tensor", 2)))
WANT = {  # style: config fields the import must set
    "qwen2": {"qkv_bias": True, "kv_heads": 2},
    "mistral": {"sliding_window": 4, "kv_heads": 2},
    "mixtral": {"experts": 4, "top_k": 2, "moe_every": 1, "no_drop": True},
    "rope-linear": {"rope_type": "linear", "rope_scaling": (4.0,)},
    "rope-dynamic": {"rope_type": "dynamic", "rope_scaling": (2.0, 8)},
    "rope-yarn": {"rope_type": "yarn"},
}


SLOW = ("rope-linear", "rope-dynamic")


@pytest.fixture(scope="module")
def cube():
    return CUBE.build(jax.devices()[:8]), ParallelPlan(mesh=CUBE).rules


def _logits(model, tokens):
    out = jax.jit(lambda m, t: m(t))(model, tokens)
    return out[0] if isinstance(out, tuple) else out  # an MoE model's: (logits, aux)


def _export(model, directory, out):
    adapter = adapter_for(read_config(directory))
    params = flatten(jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    export_hf(params, model_settings(adapter, read_config(directory)), adapter, out)


@pytest.mark.parametrize(
    "style",  # linear and dynamic in the slow set: yarn's path covers theirs in the fast one
    [pytest.param(s, marks=pytest.mark.slow if s in SLOW else ()) for s in FAMILIES],
)
def test_import_matches_transformers_and_exports_its_tensors(style, cube, tmp_path):
    directory, tokens, want = fixture(style)
    model = load_model(directory, *cube)
    for field, value in WANT[style].items():
        assert getattr(model.cfg, field) == value, field
    assert rel_err(_logits(model, tokens), want) < 1e-5
    _export(model, directory, tmp_path / "out")
    assert_like_fixture(tmp_path / "out", style, same_values=True)


@pytest.mark.slow
def test_greedy_cache_equals_argmax_without_cache(cube):
    """Mistral's window slides over the cache (12 positions, window 4); Qwen2's biases take
    the same ``Attention.biased`` on the cache path (its fine-tuning test generates)."""
    directory, tokens, _ = fixture("mistral")
    mesh, rules = cube
    model = load_model(directory, mesh, rules)
    prompt = tokens[:, :5]
    out = generate(model, prompt, mesh=mesh, rules=rules, sampling=Sampling(max_new_tokens=7))
    full = jax.jit(lambda m, t: m(t))  # 12 tokens: Mistral's window of 4 slides
    want = np.zeros((2, 12), np.int32)
    want[:, :5] = prompt
    for i in range(5, 12):
        want[:, i] = np.argmax(np.asarray(full(model, want))[:, i - 1], axis=-1)
    np.testing.assert_array_equal(out.tokens, want)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A prepared prompt/completion dataset for the fixtures' word-level vocabulary."""
    pytest.importorskip("tokenizers")
    from tokenizer_data import WORDS, lines, word_level

    where = tmp_path_factory.mktemp("prepared")
    tok = word_level(where / "tokenizer.json", lines(200, 0))
    rng = np.random.default_rng(1)
    with open(where / "sft.jsonl", "w") as f:
        for _ in range(64):
            prompt, completion = (" ".join(rng.choice(WORDS, n)) for n in (3, 4))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    assert cli.main(["data", "prepare", str(where / "sft.jsonl"), "--tokenizer", tok,
                     "--out", str(where / "data")]) == 0  # fmt: skip
    return where / "data"


@pytest.mark.slow
@pytest.mark.parametrize("style", ["qwen2", "mistral", "mixtral"])
def test_one_fine_tuning_step_exports_and_generates(style, prepared, tmp_path, capsys):
    """One step from the fixture's weights on the prepared data (the model from its
    config.json), exported as Hugging Face files of the family, and ``shardlib generate``
    from the checkpoint."""
    from shardlib.train.config import TrainConfig, override
    from shardlib.train.init_from import with_source_model
    from shardlib.train.loop import run
    from shardlib.train.setup import make_setup

    directory, _, _ = fixture(style)
    mesh = MeshSpec((("data", 1),)).build(jax.devices()[:1])  # the import on CUBE: above
    cfg = override(TrainConfig(), {
        "data": str(prepared), "steps": 1, "batch": 8, "seq": 16, "warmup": 1, "lr": 1e-2,
        "init_from": str(directory), "checkpoint_dir": str(tmp_path / "ckpt"),
    })  # fmt: skip
    setup = make_setup(with_source_model(cfg), mesh)
    assert setup.cfg.model == f"{style}-tiny"  # the family's adapter's preset
    result = run(setup, show=False)
    assert np.isfinite(result.losses).all() and len(result.losses) == 1
    out = tmp_path / "hf"
    assert cli.main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(out),
                     "--format", "hf"]) == 0  # fmt: skip
    assert_like_fixture(out, style, same_values=False)  # the family's names, shapes, config
    assert json.loads((out / "config.json").read_text())["model_type"] == style
    capsys.readouterr()
    code = cli.main(["generate", "--hf", str(out), "--prompt", "the cat", "--max-new-tokens",
                     "3", "--tokenizer", str(prepared.parent / "tokenizer.json")])  # fmt: skip
    printed = capsys.readouterr()  # Mixtral's MoE blocks too (``MoeBlock.decode``)
    assert code == 0 and printed.out.startswith("the cat "), printed.err


@pytest.mark.hf
@pytest.mark.parametrize("style", list(FAMILIES))
def test_transformers_loads_each_export(style, cube, tmp_path):
    directory, tokens, want = fixture(style)
    assert rel_err(hf_logits(directory, tokens), want) < 1e-6  # the fixture is transformers'
    _export(load_model(directory, *cube), directory, tmp_path / "out")
    assert rel_err(hf_logits(tmp_path / "out", tokens), want) < 1e-5
    assert FIXTURE_VOCAB == want.shape[-1]
