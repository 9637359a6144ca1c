"""Fully sharded data parallelism (ZeRO stage 3).

The batch is split over ``axis`` as in data parallelism, and every parameter is split over
the same axis along *one* of its dims: the first, in ``rules.SHARED_ORDER`` (vocab, embed,
mlp, heads, kv_heads, expert, head_dim), that divides by the axis. So the embedding table
and the output projection are split on vocab, every other transformer weight on embed, and
a weight without an embed dim (a ViT's bias [mlp], an expert router) on the next name that
divides; a parameter under ``rules.SHARED_MIN_ELEMENTS`` (16,384) elements none of whose
dims divides stays replicated (a larger one is an error naming the dim).
Gradients and optimizer state take the parameters' layout, so all three shrink by N.

Where it moves fewer bytes (``vocab_parallel_pays``: at most ``vocab`` tokens per FSDP
group and step), the logits' vocab dim is split over ``axis`` too (vocab-parallel): the
head multiplies the batch, gathered, by its local columns of the output projection, and
the embedding lookup reads its local rows (masked) and sums over the axis, so neither
vocab-sized table is ever gathered whole; the loss's log-softmax reduces over the split
vocab (optax's cross-entropy: XLA picks the target logit with a masked local gather and
an all-reduce of [batch, seq] values, not a gather of the logits). XLA inserts the
all-gather of each other weight before use and the reduction of its gradient. Otherwise
(or under a pipeline, ``ParallelPlan.for_workload``) the tables split on embed and are
gathered whole, as every other weight.
"""

from shardlib.core.mesh import Axis
from shardlib.core.rules import SHARED_ORDER, Rules

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


def vocab_parallel_pays(tokens: int, vocab: int, fsdp: int, tensor: int = 1) -> bool:
    """Whether the vocab-parallel head clearly moves and holds fewer bytes than gathering.

    ``tokens``: the tokens one FSDP group processes per step; ``tensor``: the tensor split
    of vocab on top of ``fsdp``. Vocab-parallel moves about six [tokens, embed] activations
    per step (the lookup's partial sums and the head input's cotangent, all-reduced; the
    head's input and the lookup's cotangent, gathered) and keeps about three of them live;
    gathering moves the two [vocab / tensor, embed] table shares about five times (three
    gathers, two gradient reductions) and keeps one or two live. So it pays while the
    activation rows are at most half of one table share: ``2 · tokens · tensor <= vocab``
    (fsdp 64 x batch 64 x seq 128 at vocab 8192 does not: +18 MiB wire, jax 0.10.2,
    CPU; fsdp 8 x tensor 8 neither: +37 MiB). Vocab must divide by fsdp · tensor.
    """
    return vocab % (fsdp * tensor) == 0 and 2 * tokens * tensor <= vocab
