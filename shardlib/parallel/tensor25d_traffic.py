"""Tesseract's wire bytes term by term, and what each of shardlib's two 2.5D forms moves.

Why a second module: ``tensor25d.py`` holds the rules; this holds the accounting that says
where the compiled program and the paper (Wang et al. 2021, Tesseract; Colossal-AI's
``Matmul_AB_2p5D`` / ``Matmul_ABT_2p5D`` / ``Matmul_ATB_2p5D``) agree and where they differ.

One linear layer Y[B, n] = X[B, m]·W[m, n] on a d x q x q grid, per device, forward and
backward. Tesseract keeps every weight as W[m/q over rows, n/q over columns] and runs every
product as SUMMA (AB forward; ABT for dX = dY·Wᵀ; ATB for dW = Xᵀ·dY). q broadcasts of a
block cost (q-1) blocks per device, as does a reduce of q partial blocks:

=====================  ======================  ============  ===========================
term                   paper collective        mesh axis     bytes
=====================  ======================  ============  ===========================
``weight forward``     AB: broadcast W         ``tensor2``   (q-1)·m·n·e/q²
``weight for dX``      ABT: broadcast W        ``tensor2``   (q-1)·m·n·e/q²
``dW reduce``          ATB: reduce dW          ``tensor2``   (q-1)·m·n·e/q² (fp32 grads)
``dW over depth``      all-reduce over depth   ``depth``     2(d-1)/d·m·n·e/q²
``X forward``          AB: broadcast X         ``tensor``    (q-1)·B·m·e/(dq²)
``dX reduce``          ABT: reduce dX          ``tensor``    (q-1)·B·m·e/(dq²)
``X for dW``           ATB: broadcast X        ``tensor``    (q-1)·B·m·e/(dq²)
=====================  ======================  ============  ===========================

``[parallel.tensor] products = "summa"`` runs exactly this (``summa_terms``): the row
products' weights laid out as the paper's (``tensor25d.summa_weights``) and each product's X
kept split for its backward and gathered again for dW (``tensor25d.summa_product``). XLA's
gathers over ``tensor2`` are the weight broadcasts, its gathers and reduce-scatters over
``tensor`` the X broadcasts and dX reductions.

``products = "megatron"`` (the default) gives each weight dim one mesh axis by its logical
name, so a Megatron pair (qkv then out projection, gate/up then down) keeps W₁ = [embed/q
over rows, mlp/q over columns] (SUMMA's layout: a **column** product) but W₂ = [mlp/q over
columns, embed/q over rows], the transpose of Tesseract's (a **row** product). What XLA
then moves per product (``megatron_terms``):

- all four weight terms: the paper's collectives and bytes;
- a column product: ``X forward`` and ``dX reduce`` as the paper; ``X for dW`` is 0: the
  gathered X of the forward is kept for dW (memory for bytes: [B/(dq), m] held instead
  of [B/(dq), m/q]);
- a row product: none of the paper's three X/dX terms (each of width m = heads·head_dim or
  mlp). Instead ``Y reduce`` (its partial sums over the columns, reduce-scattered) in the
  forward and ``dY gather`` in the backward, each (q-1)·B·n·e/(dq²) of width n = embed;
  dW reuses the gathered dY. This is Tesseract's ABT form run forward (broadcast W,
  reduce C).

Which is cheaper: the weight terms are the same. A column product moves 2 X terms in the
megatron form and 3 in summa; a row product 2 of width n in megatron and 3 of width m in
summa, fewer whenever 2n < 3m, which every transformer block satisfies. So megatron moves
fewer bytes (compiled, llama-tiny, q = 2: 0.61 / 0.74 of summa's whole layer at d = 1 / 2)
and summa less memory: megatron keeps each column product's gathered X, [B/(dq), m]
instead of [B/(dq), m/q], from the forward to dW, summa holds only split activations.
Summa is the one to pick where activation memory, not bandwidth, binds, or to compare
with the paper's figures.
``tests/parallel/test_tensor25d.py`` checks
every term of both forms against the compiled HLO.
"""

from __future__ import annotations

from dataclasses import dataclass

WEIGHT_TERMS = ("weight forward", "weight for dX", "dW reduce", "dW over depth")
"""The weight terms: the paper's and both forms' collectives coincide."""
PAPER_ACTIVATION_TERMS = ("X forward", "dX reduce", "X for dW")
"""Tesseract's activation terms (width m, the product's input)."""
ACTIVATION_KINDS = {"X forward": "all-gather", "dX reduce": "reduce-scatter",
                    "X for dW": "all-gather"}  # fmt: skip
"""The collective of each activation term over ``tensor``, each of one product's input
[B/(dq), m] gathered (or its gradient reduce-scattered): the planner's summa term books
these (``planner/cost/terms/tensor25d.py``)."""
ROW_TERMS = ("Y reduce", "dY gather")
"""What a row product of the megatron form moves instead (width n, its output)."""


@dataclass(frozen=True)
class Product:
    """One linear layer of a block, Y[B, n] = X[B, m]·W[m, n]."""

    name: str
    m: int  # input width
    n: int  # output width
    row: bool  # the second product of a Megatron pair (megatron: weight [n over rows])


def tesseract_terms(tokens: int, p: Product, *, q: int, d: int, e: int) -> dict[str, float]:
    """The paper's bytes per device for product ``p`` (forward + backward) by term;
    ``e`` is the element size of weights and activations (gradients reduced in the same)."""
    weight = (q - 1) * p.m * p.n * e / q**2
    act = (q - 1) * tokens * p.m * e / (d * q**2)
    depth = 2 * (d - 1) / d * p.m * p.n * e / q**2
    terms = dict.fromkeys(WEIGHT_TERMS[:3], weight) | {"dW over depth": depth}
    return terms | dict.fromkeys(PAPER_ACTIVATION_TERMS, act)


def summa_terms(tokens: int, p: Product, *, q: int, d: int, e: int) -> dict[str, float]:
    """What ``products = "summa"`` moves for ``p``: the paper's terms, each as the paper."""
    return tesseract_terms(tokens, p, q=q, d=d, e=e)


def megatron_terms(tokens: int, p: Product, *, q: int, d: int, e: int) -> dict[str, float]:
    """What ``products = "megatron"`` moves for ``p`` by the same terms (0 where it needs
    none), plus ``ROW_TERMS`` for a row product."""
    paper = tesseract_terms(tokens, p, q=q, d=d, e=e)
    terms = {k: paper[k] for k in WEIGHT_TERMS}
    if p.row:
        out = (q - 1) * tokens * p.n * e / (d * q**2)
        return terms | dict.fromkeys(PAPER_ACTIVATION_TERMS, 0.0) | dict.fromkeys(ROW_TERMS, out)
    return terms | {"X forward": paper["X forward"], "dX reduce": paper["dX reduce"],
                    "X for dW": 0.0} | dict.fromkeys(ROW_TERMS, 0.0)  # fmt: skip


def block_products(*, embed: int, qkv: int, attn: int, mlp_in: int, mlp: int) -> tuple:
    """A transformer layer's four products: qkv and out projection, gate/up and down
    (``qkv`` = (heads + 2·kv_heads)·head_dim, ``attn`` = heads·head_dim, ``mlp_in`` the
    gate and up widths together)."""
    return (
        Product("qkv", embed, qkv, row=False),
        Product("attention out", attn, embed, row=True),
        Product("gate/up", embed, mlp_in, row=False),
        Product("down", mlp, embed, row=True),
    )


def workload_products(w) -> tuple:
    """``block_products`` of a ``Workload``'s widths (its MLP's input width from its weight
    count: gate and up for SwiGLU, one matrix for a GELU MLP)."""
    return block_products(
        embed=w.embed, qkv=(w.heads + 2 * w.kv_heads) * w.head_dim, attn=w.heads * w.head_dim,
        mlp_in=(w.mlp_matrices - 1) * w.mlp, mlp=w.mlp,
    )  # fmt: skip
