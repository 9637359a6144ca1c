"""Logical-axis rules: a table from logical dim names to mesh axes.

Models name their dims (``("embed", "mlp")``); strategies decide which mesh axes each name is
split over. Parameters and activations have separate tables because the same name often
wants different layouts: FSDP shards the *parameter* ``embed`` dim over ``fsdp`` but keeps
the *activation* ``embed`` dim whole, while the batch is split over ``fsdp`` instead.

Every known logical name has exactly one entry (``()`` = replicated): no fallbacks, no
first-match. Resolution validates before anything is compiled, and every error names the
tensor, the dim, its size, the mesh axis, its size, and a fix.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

from jax.sharding import PartitionSpec as P

from shardlib.core.errors import ShardingError

Kind = Literal["params", "activations"]

LOGICAL_NAMES = (  # the models' vocabulary; a strategy may add names of its own
    "batch",  # examples in a (micro-)batch
    "seq",  # token positions (activations)
    "res_seq",  # token positions of the residual stream: norms, residual adds (Megatron-SP)
    "res_embed",  # model width of the residual stream between blocks (2D/3D tensor parallel)
    "embed",  # model width d_model
    "mlp",  # feed-forward hidden width
    "heads",  # query heads
    "kv_heads",  # key/value heads (grouped-query attention)
    "head_dim",  # width of one head
    "vocab",  # vocabulary
    "layers",  # stacked (scanned) layers
    "expert",  # experts of a mixture-of-experts layer
)
MEGATRON_DIMS = ("heads", "kv_heads", "mlp", "vocab")
"""The dims Megatron tensor parallelism splits (1D, and the column axis of 2D/3D)."""
SHARED_ORDER = ("vocab", "batch", "embed", "mlp", "heads", "kv_heads", "expert", "head_dim")
"""Which dim of a tensor keeps a *shared* mesh axis (``Rules.shared``: FSDP's, ZeRO's) that
several of its dims are mapped to: the first of these names whose dim divides. ``vocab``
comes first so that FSDP splits the embedding table and the output projection on vocab
(the lookup and the logits then run vocab-parallel; no whole table is gathered) and the
logits [batch, seq, vocab] keep the vocab split rather than the batch split."""
SHARED_MIN_ELEMENTS = 16_384
"""A parameter with fewer elements per layer none of whose dims divides stays replicated
over a shared axis (a bias of 100 on 8 devices; GPT-3 175B's key bias, 96 x 128 per layer,
on fsdp=256) instead of failing: it saves less memory than a refusal costs. Counted per
layer (the stacked ``layers`` dim left out), so a stacked bias is judged as the bias of one
block is. A larger one that cannot be split is an error that names the dim."""


def per_layer_elements(shape: tuple[int, ...], names: tuple[str | None, ...]) -> int:
    """Elements of one layer's slice of a parameter (all of it without a ``layers`` dim)."""
    return math.prod(s for s, n in zip(shape, names, strict=True) if n != "layers")


def _freeze(table: Mapping[str, tuple[str, ...] | str | None]) -> Mapping[str, tuple[str, ...]]:
    out = {}
    for name, axes in table.items():
        if axes is None:
            axes = ()
        elif isinstance(axes, str):
            axes = (axes,)
        out[name] = tuple(str(a) for a in axes)  # plain str, also for Axis members
    return MappingProxyType(out)


@dataclass(frozen=True)
class Rules:
    """Two tables, logical name -> tuple of mesh axes, for parameters and activations."""

    params: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """How parameter (and gradient, optimizer-state) dims are split over mesh axes."""
    activations: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """How activation dims (inputs, residual stream, logits) are split over mesh axes."""
    shared: tuple[str, ...] = ()
    """Mesh axes that may appear under several names (FSDP's and ZeRO's, which split every
    parameter along *one* of its dims): a tensor keeps each on its first dim in
    ``SHARED_ORDER`` that divides (``shared_dims``). Any other mesh axis mapped to two
    dims of one tensor is an error."""
    replicate_indivisible: tuple[str, ...] = ()
    """Logical names whose dim, where its size does not divide by the (unshared) mesh axes
    its entry gives, is replicated over them rather than refused (``for_sizes``). Tensor
    parallelism puts ``kv_heads`` here: a model with fewer K/V heads than the tensor degree
    (MQA, 1 head on ``tensor=2``) keeps every K/V head on every device of the group, as
    Megatron-LM and MaxText do, while the query heads stay split."""
    per_weight: Mapping[tuple[str, ...], Mapping[str, str]] = field(default_factory=dict)
    """Weights laid out against the name table, keyed by their logical names (a stacked
    ``layers`` dim left out): each maps a dim's name to the name whose parameter entry that
    dim takes instead of its own. ``{("mlp", "embed"): {"mlp": "embed", "embed": "mlp"}}``
    gives MLP-down the axes of MLP-up's dims, swapped, while every other weight keeps the
    table's: a layout per product rather than per name (Tesseract's SUMMA form of 2.5D,
    ``parallel/tensor25d.py``), with the model naming logical dims only. An alias, not
    axes, so what other strategies add to an entry (ZeRO's axis) follows it; gradients
    and optimizer state follow the parameters."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "params", _freeze(self.params))
        object.__setattr__(self, "activations", _freeze(self.activations))
        weights = {tuple(k): MappingProxyType(dict(v)) for k, v in self.per_weight.items()}
        object.__setattr__(self, "per_weight", MappingProxyType(weights))
        object.__setattr__(self, "shared", tuple(str(a) for a in self.shared))
        object.__setattr__(self, "replicate_indivisible", tuple(self.replicate_indivisible))

    def table(
        self, kind: Kind, names: tuple[str | None, ...] = ()
    ) -> Mapping[str, tuple[str, ...]]:
        """The ``kind`` table; for a parameter named ``names``, with its ``per_weight``
        entries in place of the table's."""
        if kind != "params":
            return self.activations
        own = self.per_weight.get(tuple(n for n in names if n != "layers")) if names else None
        if own is None:
            return self.params
        return MappingProxyType({**self.params, **{n: self.params[a] for n, a in own.items()}})

    def mesh_axes(self) -> set[str]:
        return {a for t in (self.params, self.activations) for axes in t.values() for a in axes}

    def replace(self, *, params=None, activations=None) -> Rules:
        """A copy with some entries overridden (whole entries, never merged)."""
        return dataclasses.replace(
            self,
            params={**self.params, **(params or {})},
            activations={**self.activations, **(activations or {})},
        )

    def for_sizes(self, sizes: Mapping[str, int], mesh_axes: Mapping[str, int]) -> Rules:
        """These rules for dims of these sizes: each ``replicate_indivisible`` name whose
        size does not divide by its entry's unshared mesh axes loses them (in both tables;
        a shared axis stays for ``shared_dims`` to place). ``resolve_spec`` applies it per
        tensor; a caller that lays out a tensor without its shape (``Rules.spec``) passes
        the sizes it knows."""
        drop: dict[str, dict[str, tuple[str, ...]]] = {"params": {}, "activations": {}}
        for name in self.replicate_indivisible:
            if name not in sizes:
                continue
            for kind, table in (("params", self.params), ("activations", self.activations)):
                axes = table.get(name, ())
                ways = math.prod(mesh_axes.get(a, 1) for a in axes if a not in self.shared)
                if sizes[name] % ways:
                    drop[kind][name] = tuple(a for a in axes if a in self.shared)
        if not drop["params"] and not drop["activations"]:
            return self
        return self.replace(**drop)

    def with_name(
        self,
        name: str,
        *,
        params: tuple[str, ...] | str | None = None,
        activations: tuple[str, ...] | str | None = None,
    ) -> Rules:
        """A copy that knows one more logical name, in both tables at once.

        A model's own name (``"patch"``, ``"classes"``) must be in the parameter table for
        its weights and in the activation table for ``constrain``; adding it to one table
        only fails later, on the first tensor of the other kind. ``None`` (the default)
        replicates it; ``"tensor"`` or ``("fsdp", "tensor")`` split it over those mesh axes.
        Adding a name that is already known is refused: use ``replace`` to change an entry.
        """
        for kind, table in (("params", self.params), ("activations", self.activations)):
            if name in table:
                raise ShardingError(
                    f"Rules.with_name: logical name {name!r} is already in the {kind} rules "
                    f"(-> {table[name]}). Fix: pick another name, or change the entry with "
                    f"rules.replace({kind}={{{name!r}: ...}})."
                )
        return self.replace(params={name: params}, activations={name: activations})

    def spec(self, names: tuple[str | None, ...], kind: Kind = "activations") -> P:
        """PartitionSpec for a tuple of logical names, without shape checks."""
        table = self.table(kind, names)
        dims = shared_dims(self, names, None, kind, {})
        parts = []
        for dim, name in enumerate(names):
            axes = () if name is None else dims.get(dim, table[name])
            parts.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return make_spec(parts)

    def check_mesh(self, mesh_axes: Mapping[str, int], where: str = "rules") -> None:
        """Every mesh axis a rule names must exist in the mesh."""
        for kind in ("params", "activations"):
            for name, axes in self.table(kind).items():
                for ax in axes:
                    if ax not in mesh_axes:
                        raise ShardingError(
                            f"{where}: {kind} rule {name!r} -> {axes} names mesh axis {ax!r}, "
                            f"which the mesh ({fmt_mesh(mesh_axes)}) does not have. Fix: add "
                            f"{ax!r} to the mesh or drop it from the rule."
                        )


def base_rules(extra_names: tuple[str, ...] = ()) -> Rules:
    """Every logical name of the models' vocabulary (and ``extra_names``: those strategies
    add, ``ParallelPlan.logical_names``), replicated. Strategies fill entries in."""
    empty = {n: () for n in (*LOGICAL_NAMES, *extra_names)}
    return Rules(params=empty, activations=empty)


def compose(*parts: Rules) -> Rules:
    """Merge strategy rule sets: a name's mesh axes are concatenated in argument order.

    ``compose(data_parallel(), fsdp())`` maps activation ``batch`` to ``("data", "fsdp")``.
    A mesh axis claimed twice for the same name is a conflict, not something to dedupe.
    """
    tables: dict[str, dict[str, tuple[str, ...]]] = {"params": {}, "activations": {}}
    shared = tuple(dict.fromkeys(a for part in parts for a in part.shared))
    weights: dict[tuple[str, ...], Mapping[str, str]] = {}
    for part in parts:
        for key, entries in part.per_weight.items():
            if key in weights:
                raise ShardingError(
                    f"compose: weight {key} gets its own layout from two strategies. Fix: "
                    "give it one, in the strategy that owns its dims' mesh axes."
                )
            weights[key] = entries
    loose = tuple(dict.fromkeys(n for part in parts for n in part.replicate_indivisible))
    for part in parts:
        for kind, table in tables.items():
            for name, axes in part.table(kind).items():
                have = table.get(name, ())
                dup = set(have) & set(axes)
                if dup:
                    raise ShardingError(
                        f"compose: {kind} rule {name!r} gets mesh axis {sorted(dup)[0]!r} from "
                        "two strategies. Fix: give each strategy its own mesh axis."
                    )
                table[name] = have + tuple(axes)
    return Rules(
        params=tables["params"],
        activations=tables["activations"],
        shared=shared,
        replicate_indivisible=loose,
        per_weight=weights,
    )


def shared_dims(
    rules: Rules,
    names: tuple[str | None, ...],
    shape: tuple[int, ...] | None,
    kind: Kind,
    mesh_axes: Mapping[str, int],
) -> dict[int, tuple[str, ...]]:
    """``{dim: mesh axes}`` for the dims of one tensor whose entry names a shared axis.

    Each shared axis goes to the first dim, in ``SHARED_ORDER`` (then dim order), whose
    name maps to it and whose size divides by it and the axes already there; every other
    dim drops it. If none divides, a parameter under ``SHARED_MIN_ELEMENTS`` elements per
    layer is replicated over the axis; any other tensor leaves it on its first such dim, for
    ``resolve_spec`` to report. Without ``shape`` (a spec with no tensor) every dim counts
    as divisible.
    """
    if not rules.shared:
        return {}
    table = rules.table(kind, names)
    rank = {n: i for i, n in enumerate(SHARED_ORDER)}
    order = sorted(
        (d for d, n in enumerate(names) if n is not None and n in table),
        key=lambda d: (rank.get(names[d], len(rank)), d),
    )
    small = (
        kind == "params"
        and shape is not None
        and per_layer_elements(shape, names) < (SHARED_MIN_ELEMENTS)
    )
    dims = {
        d: tuple(a for a in table[n] if a not in rules.shared)
        for d, n in enumerate(names)
        if n is not None and n in table and set(table[n]) & set(rules.shared)
    }
    for axis in rules.shared:
        candidates = [d for d in order if axis in table[names[d]]]
        fits = [
            d
            for d in candidates
            if shape is None
            or shape[d] % math.prod(mesh_axes.get(a, 1) for a in (*dims[d], axis)) == 0
        ]
        if not fits and small:
            continue  # a small parameter no dim of which divides: replicated over ``axis``
        # none divides: the first keeps it, so that resolve_spec names the dim that fails
        for d in (fits or candidates)[:1]:
            keep = set(dims[d]) | {axis}
            dims[d] = tuple(a for a in table[names[d]] if a in keep)
    return dims


def fmt_mesh(mesh_axes: Mapping[str, int]) -> str:
    return " x ".join(f"{n}={s}" for n, s in mesh_axes.items()) or "no axes"


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis, or a tuple of axes)."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def entry_without(entry, axes) -> str | tuple[str, ...] | None:
    """One PartitionSpec entry without the mesh axes in ``axes``, in the entry's form."""
    kept = tuple(a for a in entry_axes(entry) if a not in axes)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def make_spec(parts: list) -> P:
    """P(None, "x", None) and P(None, "x") are one layout: keep the short form."""
    while parts and parts[-1] is None:
        parts.pop()
    return P(*parts)
