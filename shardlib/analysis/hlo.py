"""Read the optimized, SPMD-partitioned HLO text that ``compiled.as_text()`` returns.

Why parse text at all: the text is the only view of the per-device program that is the same
on every backend and jax version we support, and it holds everything a layout report needs
(collectives with their replica groups, while loops with their trip counts, dots with their
contracting dims). XLA's own ``cost_analysis()`` counts a while body once on CPU, so we walk
the call graph ourselves and multiply by ``known_trip_count``.

Only what the report needs is parsed: computations, instructions (name, result type, opcode,
operand names, raw attribute text), the call graph, replica groups, shapes. Everything here is
pure text -> data; turning device ids into mesh axes happens in ``explain``.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass

from shardlib.analysis.groups import (
    close_bracket,
    parse_replica_groups,
    parse_source_target_pairs,
)
from shardlib.core.scopes import ONE_TRIP_SCOPE  # a while run once: its body counted once

# Bits per element. f8*/f4* variants are matched by prefix in ``dtype_bits``.
_DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16,
    "s32": 32, "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64,
    "c64": 64, "c128": 128, "token": 0,
}  # fmt: skip

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")  # fmt: skip

# Attributes that name a computation run *as part of* the caller. ``to_apply`` is left out on
# purpose: reducers of reduce/all-reduce/sort are accounted for by the op that applies them.
_CALL_ATTR = re.compile(r"\b(body|condition|calls|true_computation|false_computation)=%?([\w.\-]+)")
_CALL_LIST_ATTR = re.compile(r"\b(branch_computations|called_computations)=\{([^}]*)\}")
_ARRAY_TYPE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_ONE_TRIP = re.compile(rf"\b{ONE_TRIP_SCOPE}\b")  # also as vmap(one_trip) in op names
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_NAME = re.compile(r"%([\w.\-]+)")


def dtype_bits(dtype: str) -> int:
    """Bits per element of an HLO element type (0 for unknown types, e.g. opaque)."""
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    if dtype.startswith("f8"):
        return 8
    if dtype.startswith("f4"):
        return 4
    return 0


@dataclass(frozen=True)
class ArrayType:
    """One array of an HLO result type: ``f32[8,1024]{1,0}`` -> ``("f32", (8, 1024))``."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        return (self.elements * dtype_bits(self.dtype) + 7) // 8


@functools.lru_cache(maxsize=1 << 16)
def parse_type(text: str) -> tuple[ArrayType, ...]:
    """The arrays of a result type, flattening tuples: ``(f32[2], bf16[3,4])`` -> two arrays.

    Layouts (``{1,0}``) and ``/*index=5*/`` comments never contain ``[`` and are skipped;
    dynamic dims print as ``<=8`` and count at their bound. Cached: a module repeats a few
    types thousands of times, and each instruction's are read for FLOPs, bytes and groups.
    """
    arrays = []
    for dtype, dims in _ARRAY_TYPE.findall(text):
        sizes = tuple(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip())
        arrays.append(ArrayType(dtype, sizes))
    return tuple(arrays)


def type_bytes(text: str) -> int:
    """Total bytes of a (possibly tuple) result type."""
    return sum(a.bytes for a in parse_type(text))


@dataclass(frozen=True)
class Instruction:
    """One HLO instruction, kept close to the text: attributes stay a raw string."""

    name: str
    opcode: str
    type_text: str
    operands: tuple[str, ...]
    attrs: str

    @property
    def arrays(self) -> tuple[ArrayType, ...]:
        return parse_type(self.type_text)

    @property
    def op_name(self) -> str:
        """The JAX-level op name from metadata (e.g. ``jit(f)/dot_general``), if any."""
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""


@dataclass(frozen=True)
class Computation:
    name: str
    is_entry: bool
    instructions: tuple[Instruction, ...]

    def types(self) -> dict[str, str]:
        """Instruction name -> result type text, to size operands (printed by name only)."""
        return {i.name: i.type_text for i in self.instructions}


@dataclass(frozen=True)
class HloModule:
    computations: dict[str, Computation]
    entry: str
    num_partitions: int
    replica_count: int

    @property
    def num_devices(self) -> int:
        return self.num_partitions * self.replica_count


_SPLITTERS = re.compile(r"[()\[\]{},]")


def _split_top(text: str) -> list[str]:
    """Split on commas that are not nested in brackets."""
    parts, depth, begin = [], 0, 0
    for m in _SPLITTERS.finditer(text):
        c = m.group()
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            parts.append(text[begin : m.start()])
            begin = m.end()
    parts.append(text[begin:])
    return [p.strip() for p in parts if p.strip()]


def parse_instruction(line: str) -> Instruction | None:
    """Parse ``[ROOT] %name = TYPE opcode(operands), attrs``; None for other lines."""
    m = _INSTR.match(line)
    if not m:
        return None
    pos = m.end()
    if line.startswith("(", pos):
        end = close_bracket(line, pos)
    else:
        end = line.find(" ", pos)
        if end < 0:
            return None
    type_text = line[pos:end]
    op = _OPCODE.match(line, end)
    if not op:
        return None
    open_at = op.end() - 1
    close_at = close_bracket(line, open_at)
    operands = []
    for part in _split_top(line[open_at + 1 : close_at - 1]):
        names = _NAME.findall(part)
        if names:  # newer printers write "f32[8]{0} %x"; older ones just "%x"
            operands.append(names[-1])
    attrs = line[close_at:].lstrip(", ")
    return Instruction(m.group(1), op.group(1), type_text, tuple(operands), attrs)


def parse_module(text: str) -> HloModule:
    """Split module text into computations of parsed instructions."""
    computations: dict[str, Computation] = {}
    entry = ""
    current: tuple[str, bool, list[Instruction]] | None = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and line.rstrip().endswith("{") and not line.startswith("HloModule"):
                current = (m.group(2), bool(m.group(1)), [])
            continue
        if line.strip() == "}":
            name, is_entry, instructions = current
            computations[name] = Computation(name, is_entry, tuple(instructions))
            entry = name if is_entry else entry
            current = None
            continue
        instruction = parse_instruction(line)
        if instruction is not None:
            current[2].append(instruction)
    header = text[: text.find("\n")] if "\n" in text else text
    partitions = re.search(r"num_partitions=(\d+)", header)
    replicas = re.search(r"replica_count=(\d+)", header)
    if not entry and computations:  # a bare computation pasted in a test
        entry = next(reversed(computations))
    return HloModule(
        computations,
        entry,
        int(partitions.group(1)) if partitions else 1,
        int(replicas.group(1)) if replicas else 1,
    )


def trip_count(instruction: Instruction) -> int | None:
    """``known_trip_count`` from a while's backend_config, or None when XLA did not know it
    (1 for a loop built under ``ONE_TRIP_SCOPE``)."""
    m = _TRIP_COUNT.search(instruction.attrs)
    if m:
        return int(m.group(1))
    return 1 if _ONE_TRIP.search(instruction.op_name) else None


def _callees(instruction: Instruction) -> Iterator[tuple[str, str]]:
    """(attribute, computation) pairs this instruction runs as part of itself."""
    if instruction.opcode.endswith(("-done", "-update")):
        return  # an async op's done/update name the same computation as its start
    for attr, callee in _CALL_ATTR.findall(instruction.attrs):
        yield attr, callee
    if instruction.opcode == "call":  # a plain call names its callee with to_apply=
        yield from re.findall(r"\b(to_apply)=%?([\w.\-]+)", instruction.attrs)
    for attr, names in _CALL_LIST_ATTR.findall(instruction.attrs):
        for callee in re.findall(r"%?([\w.\-]+)", names):
            yield attr, callee


def call_multipliers(module: HloModule) -> tuple[dict[str, int], tuple[str, ...]]:
    """How many times each computation runs per execution of ENTRY.

    A while's body and condition run ``known_trip_count`` times per run of the caller (nested
    loops multiply); a computation called from several places sums its callers. Both branches
    of a conditional are counted as if taken (an upper bound). A while without a known trip
    count is counted once and reported in the returned warnings.
    """
    edges: dict[str, list[tuple[str, int]]] = {}
    warnings = []
    for comp in module.computations.values():
        for inst in comp.instructions:
            factor = 1
            if inst.opcode == "while":
                n = trip_count(inst)
                if n is None:
                    warnings.append(
                        f"while {inst.name} in {comp.name} has no known_trip_count: counted once"
                    )
                factor = 1 if n is None else n
            for _, callee in _callees(inst):
                if callee in module.computations:
                    edges.setdefault(comp.name, []).append((callee, factor))
    order: list[str] = []  # reverse post-order from ENTRY: callers before callees
    seen: set[str] = set()

    def visit(name: str) -> None:
        seen.add(name)
        for callee, _ in edges.get(name, ()):
            if callee not in seen:
                visit(callee)
        order.append(name)

    if module.entry:
        visit(module.entry)
    multipliers = dict.fromkeys(module.computations, 0)
    if module.entry:
        multipliers[module.entry] = 1
    for name in reversed(order):
        for callee, factor in edges.get(name, ()):
            multipliers[callee] += multipliers[name] * factor
    return multipliers, tuple(warnings)


@dataclass(frozen=True)
class RawCollective:
    """A collective as it stands in the HLO, before mesh axes are attached."""

    name: str
    kind: str
    computation: str
    count: int
    buffer_bytes: int  # per execution, the full M of REFERENCE.md
    groups: tuple[tuple[int, ...], ...]  # empty for collective-permute
    pairs: tuple[tuple[int, int], ...]  # collective-permute only
    op_name: str


def _kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    if base == "ragged-all-to-all":
        return "all-to-all"
    return base if base in COLLECTIVE_KINDS else None


def collectives(module: HloModule, multipliers: dict[str, int]) -> list[RawCollective]:
    """Every collective instruction reachable from ENTRY, async start/done pairs once.

    M follows REFERENCE.md: all-gather counts its result, i.e. operands x group size; every
    other kind its operands (for reduce-scatter that is the unscattered input). Operands are
    sized from their defining instruction; if that fails, the result type stands in.
    """
    found = []
    for comp in module.computations.values():
        if multipliers.get(comp.name, 0) == 0:
            continue
        types = None
        for inst in comp.instructions:
            kind = _kind(inst.opcode)
            if kind is None:
                continue
            types = types if types is not None else comp.types()
            operands = [types[o] for o in inst.operands if o in types]
            if kind == "collective-permute" and len(inst.operands) == 4:
                operands = operands[:1]  # in-place form: (input, output, in_idx, out_idx)
            operand_bytes = sum(type_bytes(t) for t in operands)
            groups = parse_replica_groups(inst.attrs, module.num_devices)
            pairs = parse_source_target_pairs(inst.attrs) if kind == "collective-permute" else []
            if groups is None:
                groups = [] if pairs else [list(range(module.num_devices))]
            group_size = max((len(g) for g in groups), default=1)
            if len(operands) != len(inst.operands) or operand_bytes == 0:
                result = type_bytes(inst.type_text)  # fallback: size from the result
                operand_bytes = result // group_size if kind == "all-gather" else result
                if kind == "reduce-scatter":
                    operand_bytes = result * group_size
            buffer = operand_bytes * group_size if kind == "all-gather" else operand_bytes
            found.append(
                RawCollective(
                    inst.name,
                    kind,
                    comp.name,
                    multipliers[comp.name],
                    buffer,
                    tuple(tuple(g) for g in groups),
                    tuple(pairs),
                    inst.op_name,
                )
            )
    return found
