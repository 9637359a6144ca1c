"""Fully sharded data parallelism (ZeRO stage 3).

The batch is split over ``axis`` as in data parallelism, and every parameter is split over
the same axis along *one* of its dims: the first, in ``rules.SHARED_ORDER`` (vocab, embed,
mlp, heads, kv_heads, expert, head_dim), that divides by the axis. So the embedding table
and the output projection are split on vocab, every other transformer weight on embed, and
a weight without an embed dim (a ViT's bias [mlp], an expert router) on the next name that
divides; parameters under ``rules.SHARED_MIN_ELEMENTS`` (16,384) elements stay replicated.
Gradients and optimizer state take the parameters' layout, so all three shrink by N.

Where it moves fewer bytes (``vocab_parallel_pays``: at most ``vocab`` tokens per FSDP
group and step), the logits' vocab dim is split over ``axis`` too (vocab-parallel): the
head multiplies the batch, gathered, by its local columns of the output projection, and
the embedding lookup reads its local rows (masked) and sums over the axis, so neither
vocab-sized table is ever
gathered whole; the loss's log-softmax reduces over the split vocab
(``shardlib.train.step.cross_entropy``). XLA inserts the all-gather of each other weight
before use and the reduction of its gradient. Otherwise the tables split on embed and are
gathered whole, as every other weight.
"""

from shardlib.mesh import Axis
from shardlib.rules import SHARED_ORDER, Rules

PARAM_DIMS = tuple(name for name in SHARED_ORDER if name != "batch")
"""The parameter dims FSDP may split, in the order it tries them."""


def fsdp(*, axis: str = Axis.FSDP, vocab_parallel: bool = True) -> Rules:
    """Parameters split over ``axis`` along one dim each; activations' ``batch`` too.

    ``vocab_parallel``: the embedding table and output projection split on vocab and the
    logits' ``vocab`` over ``axis`` (it then takes precedence over their batch); False:
    the tables split on embed and are gathered whole where they are used.
    """
    names = PARAM_DIMS if vocab_parallel else tuple(n for n in PARAM_DIMS if n != "vocab")
    activations = {"batch": (axis,)} | ({"vocab": (axis,)} if vocab_parallel else {})
    return Rules(params={name: (axis,) for name in names}, activations=activations, shared=(axis,))


def vocab_parallel_pays(tokens: int, vocab: int, ways: int) -> bool:
    """Whether the vocab-parallel head moves fewer bytes than gathering the tables.

    ``tokens``: the tokens one FSDP group (``ways`` devices, times any tensor split of
    vocab) processes per step. Vocab-parallel moves four [tokens, embed] activations (lookup
    sum, its cotangent, the head's input and its cotangent); gathering moves the two
    [vocab, embed] tables once or twice each plus their gradients, about four table-sized
    passes: the activations are the cheaper while ``tokens <= vocab``. Vocab must divide.
    """
    return vocab % ways == 0 and tokens <= vocab
