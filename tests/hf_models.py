"""Tiny random Llamas made with ``transformers`` (nothing is downloaded), in two styles.

Llama 2 style: multi-head attention, plain RoPE, a separate LM head. Llama 3 style:
grouped-query attention, llama3 RoPE scaling, tied embeddings. Shared by the import/export
tests (``test_hf.py``, ``test_hf_live.py``) and the fine-tuning chain
(``test_hf_finetune.py``).

Default tests read one of each, saved with the logits transformers computed for them, from
``interop/fixtures/`` (``fixture``): they need neither transformers nor torch. Tests marked
``hf`` (``pip install -e ".[hf]"``) make models and compute logits live (``make_hf``,
``hf_logits``), and check that transformers still computes the fixtures' logits.
"""

from pathlib import Path

import numpy as np
from tokenizer_data import SPECIALS, WORDS

FIXTURES = Path(__file__).parent / "interop" / "fixtures"
"""``STYLE/config.json``, ``STYLE/model.safetensors`` and ``STYLE/logits.npz`` (the tokens
and transformers' logits for them); ``regenerate.py`` writes them."""
FIXTURE_VOCAB = len(WORDS) + len(SPECIALS)
"""The fixtures' vocabulary: the fine-tuning chain's word-level tokenizer (16 words, <unk>,
</s>), so one model per style serves every test."""

STYLES = {
    "llama2": dict(num_key_value_heads=4, tie_word_embeddings=False),
    "llama3": dict(
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_parameters=dict(
            rope_type="llama3", rope_theta=500_000.0, factor=8.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=16,
        ),
    ),
}  # fmt: skip


FAMILIES = {  # style: (transformers config and model classes, config fields)
    # Qwen2: q/k/v biases (moved off their initial zeros in ``make_hf``), GQA, separate head
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
    # Mistral: each token sees the 4 tokens up to itself (the fixtures' rows have 12)
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2,
                                                           sliding_window=4)),
    # Mixtral: 4 experts, top 2, onto models/moe (the router's std 0.2 picks decisively)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_key_value_heads=2,
                                                           num_local_experts=4)),
    # Llama-family RoPE scalings transformers applies; dynamic NTK past 8 positions
    "rope-linear": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters=dict(rope_type="linear", rope_theta=10_000.0, factor=4.0))),
    "rope-dynamic": ("LlamaConfig", "LlamaForCausalLM", dict(
        max_position_embeddings=8,
        rope_parameters=dict(rope_type="dynamic", rope_theta=10_000.0, factor=2.0))),
    "rope-yarn": ("LlamaConfig", "LlamaForCausalLM", dict(
        rope_parameters=dict(rope_type="yarn", rope_theta=10_000.0, factor=4.0,
                             original_max_position_embeddings=16))),
}  # fmt: skip
"""Llama-shaped families and RoPE scalings beyond ``STYLES`` (``tests/models/
test_llama_family_hf.py``), each a fixture too."""


def make_hf(style: str, out, vocab: int, seed: int = 0):
    """A ``style`` model (``STYLES`` or ``FAMILIES``) with ``vocab`` tokens (2 layers, 64
    positions unless the style says), saved to ``out``."""
    import torch
    import transformers

    config_class, model_class, fields = (
        FAMILIES[style] if style in FAMILIES else ("LlamaConfig", "LlamaForCausalLM", STYLES[style])
    )
    fields = dict(max_position_embeddings=64) | fields
    cfg = getattr(transformers, config_class)(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, head_dim=8, rms_norm_eps=1e-5,
        initializer_range=0.2,  # std 0.02 (the default) caps a frozen head's |logits| below 1
        **fields,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(cfg).eval()
    with torch.no_grad():  # biases (Qwen2's q/k/v) away from their initial zeros
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.add_(0.2 * torch.randn_like(p))
    model.save_pretrained(out, safe_serialization=True)
    return model


def hf_logits(model_or_dir, tokens):
    """transformers' logits [batch, seq, vocab] for ``tokens`` [batch, seq]."""
    import torch
    import transformers

    model = model_or_dir
    if not hasattr(model, "forward"):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_or_dir).eval()
    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens))).logits.numpy()


def rel_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(b)))


def fixture(style: str) -> tuple[Path, np.ndarray, np.ndarray]:
    """A ``style`` fixture: its directory, tokens [2, 12] and transformers' logits for them
    [2, 12, vocab] (fp32)."""
    directory = FIXTURES / style
    with np.load(directory / "logits.npz") as saved:
        return directory, saved["tokens"], saved["logits"]


def assert_like_fixture(directory, style: str, *, same_values: bool) -> None:
    """``directory`` (an export) holds the ``style`` fixture's tensors - every name, shape and
    dtype, and with ``same_values`` every value - and a ``config.json`` that agrees with the
    fixture's on every key both have: the same model, in the form transformers reads."""
    import json

    from safetensors.numpy import load_file

    def tensors(where):
        return {k: v for f in sorted(Path(where).glob("*.safetensors")) for k, v in
                load_file(f).items()}  # fmt: skip

    ours, theirs = tensors(directory), tensors(FIXTURES / style)
    assert sorted(ours) == sorted(theirs)
    for name, x in theirs.items():
        assert (ours[name].shape, ours[name].dtype) == (x.shape, x.dtype), name
        if same_values:
            np.testing.assert_array_equal(ours[name], x, err_msg=name)
    config = json.loads((Path(directory) / "config.json").read_text())
    want = json.loads((FIXTURES / style / "config.json").read_text())
    differ = {k: (config[k], want[k]) for k in config.keys() & want.keys() if config[k] != want[k]}
    assert not differ, differ
