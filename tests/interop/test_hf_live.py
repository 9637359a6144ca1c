"""shardlib against ``transformers`` itself (marker ``hf``: ``pip install -e ".[hf]"``, then
``pytest -m hf``; skipped without transformers).

The default tests compare with logits stored in ``fixtures/``; these check that
transformers still computes them from the fixtures' files, import models transformers
makes now (at the byte vocabulary, 256), and load an export in transformers.
"""

import jax
import numpy as np
import pytest
from flax import nnx
from hf_models import STYLES, fixture, hf_logits, make_hf, rel_err

from shardlib.core.mesh import MeshSpec
from shardlib.core.model import hf_adapter
from shardlib.interop.hf import model_settings, read_config
from shardlib.interop.hf_io import export_hf, flatten
from shardlib.parallel.plan import ParallelPlan
from shardlib.train.init_from import load_model

pytestmark = pytest.mark.hf
CUBE = MeshSpec((("data", 2), ("fsdp", 2), ("tensor", 2)))
VOCAB = 256
LLAMA = hf_adapter("llama-tiny")


@pytest.fixture(scope="module")
def cube():
    return CUBE.build(jax.devices()[:8]), ParallelPlan(mesh=CUBE).rules


@pytest.mark.parametrize("style", list(STYLES))
def test_fixture_logits_are_transformers(style):
    """The stored logits are what this transformers computes from the stored files (a
    regenerated fixture would only differ by transformers' random initialisation)."""
    directory, tokens, want = fixture(style)
    assert rel_err(hf_logits(directory, tokens), want) < 1e-6


@pytest.mark.parametrize("style", list(STYLES))
def test_import_matches_transformers_on_cube(style, cube, tmp_path):
    hf = make_hf(style, tmp_path / style, VOCAB)
    model = load_model(tmp_path / style, *cube)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
    logits = jax.jit(lambda m, t: m(t))(model, tokens)
    assert rel_err(logits, hf_logits(hf, tokens)) < 1e-5


@pytest.mark.parametrize("style", list(STYLES))
def test_transformers_loads_an_export(style, cube, tmp_path):
    directory, tokens, want = fixture(style)
    model = load_model(directory, *cube)
    params = flatten(jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    settings = model_settings(LLAMA, read_config(directory))
    export_hf(params, settings, LLAMA, tmp_path / "out", shard_bytes=20_000)  # 4 shards
    assert rel_err(hf_logits(tmp_path / "out", tokens), want) < 1e-5


def test_gpt2_import_and_export_match_transformers(cube, tmp_path):
    """A tiny random ``GPT2LMHeadModel`` (Conv1D weights, fused c_attn, tied head) imports
    on the cube with transformers' logits, and transformers loads shardlib's export with
    them again (``models/gpt/hf.py``; ``tests/models/test_gpt_hf.py`` checks the same
    against a numpy GPT-2 without transformers)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    hf = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # biases and norms away from their initial 0 and 1
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(tmp_path / "gpt2", safe_serialization=True)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
    want = hf_logits(hf, tokens)
    model = load_model(tmp_path / "gpt2", *cube)
    assert rel_err(jax.jit(lambda m, t: m(t))(model, tokens), want) < 1e-5
    gpt2 = hf_adapter("gpt2")
    params = flatten(jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
    settings = model_settings(gpt2, read_config(tmp_path / "gpt2"))
    export_hf(params, settings, gpt2, tmp_path / "out")
    assert rel_err(hf_logits(tmp_path / "out", tokens), want) < 1e-5
