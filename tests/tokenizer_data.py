"""Tiny tokenizers and texts that tests train and write themselves (nothing is downloaded).

Shared by the data tests and the Hugging Face fine-tuning chain: a ``tokenizers`` WordLevel
tokenizer trained on random lines over a 16-word vocabulary (plus ``<unk>`` and ``</s>``).
"""

import random

WORDS = "the cat sat on a mat dog ran far away quick brown fox jumps over lazy".split()
SPECIALS = ["<unk>", "</s>"]


def lines(n: int, seed: int, longest: int = 20) -> list[str]:
    """``n`` lines of 3 to ``longest`` words drawn uniformly from ``WORDS``."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, longest))) for _ in range(n)]


def word_level(path, texts=None, vocab: dict | None = None) -> str:
    """A WordLevel tokenizer.json at ``path``: trained on ``texts``, or ``vocab`` as given."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if texts is not None:
        tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    tok.save(str(path))
    return str(path)
