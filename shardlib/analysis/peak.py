"""What is live at a compiled step's memory peak, read off XLA's own heap simulation.

``compiled.memory_analysis()`` gives one number, the bytes the step allocates: its
arguments and outputs plus one temporary block into which XLA's heap simulator packs every
intermediate buffer at an offset. It does not say when the peak comes, what is live then,
or how much of the block is packing (buffers whose lifetimes never overlap, but whose
offsets do not let them share space). Those are what one needs to reduce memory, and to
check a model of it part by part: a sum of the step's parts (weights, saved activations,
the loss head's logits, the gradients) over-books a step whose peak comes before the
gradients exist.

XLA writes the heap simulation's peak when asked to dump the compiled module
(``--xla_dump_to``; here as a per-compile option, so nothing else is dumped): the buffers
live at the peak, grouped by the JAX operation (``op_name`` metadata) or argument path they
came from. ``explain(..., peak=True)`` compiles with that option into a temporary directory
and keeps the breakdown as a ``Peak``.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from shardlib.analysis.report import format_bytes

HEADER = "Stack trace breakdown for peak usage:"
_LINE = re.compile(
    r"^(?P<indent>[\s│├└─]*)(?P<label>[^\s│├└─].*?) \([\d.]+%, total: (?P<total>[\d ]+) bytes"
)
_ARGUMENT = re.compile(r"[^\[.]+(\[[^\]]*\]|\.[^\[.]+)?")  # the root and its first key
_UNNAMED = re.compile(r"^[a-z_-]+(\.\d+)+$")
UNNAMED = "XLA buffers without a JAX operation (copies, broadcasts)"
SHOWN = 8
"""Parts listed in the rendered table (the rest are summed on one line)."""
INSIDE = 3
"""Operations listed inside the largest part (a layer loop: what its body keeps)."""


@dataclass(frozen=True)
class Peak:
    """The most bytes live at once in one compiled step, by where they came from."""

    live_bytes: int
    """XLA's count at its heap simulation's peak, per device: the values live then and the
    arguments. Values that share one buffer in place (a loop's carried stack, its
    update) are each counted, so it can exceed what is allocated (jax 0.12)."""
    parts: tuple[tuple[str, int], ...]
    """(what, bytes) live at the peak, largest first: a JAX operation path
    (``jit(train_step)/jvp()/while``: the forward pass's layer loop), an argument (``state``,
    its optimizer state's leaves by path), or an HLO instruction without metadata."""
    inside: tuple[tuple[str, int], ...] = ()
    """The largest operations inside ``where`` (for a layer loop: the saved activations
    its body stacks, ``.../dynamic_update_slice``), largest first."""
    allocated_bytes: int = 0
    """``memory_analysis()``'s total for the same program (arguments, outputs, the packed
    temporary block); 0 where unknown."""

    @property
    def packing_bytes(self) -> int:
        """Allocated beyond the live count (0 when it is not below the allocation): at least
        what XLA's packing of buffers into one block costs (lifetimes that never overlap,
        offsets that do not let them share space)."""
        return max(0, self.allocated_bytes - self.live_bytes) if self.allocated_bytes else 0

    @property
    def where(self) -> str:
        """The largest operation group live at the peak (not an argument)."""
        ops = [label for label, _ in self.parts if "/" in label]
        return ops[0] if ops else ""

    @property
    def phase(self) -> str:
        """forward, backward or other: JAX names the backward pass's operations
        ``transpose(jvp(...))`` and the forward's ``jvp(...)``. Where the largest part is a
        loop around both (micro-batches, a pipeline's), its largest operation decides."""
        for text in (self.where, *(op for op, _ in self.inside[:1])):
            if "transpose(" in text:
                return "backward"
            if "jvp(" in text:
                return "forward"
        return "other"

    def to_json(self) -> dict:
        return {
            "live_bytes": self.live_bytes,
            "allocated_bytes": self.allocated_bytes,
            "packing_bytes": self.packing_bytes,
            "where": self.where,
            "phase": self.phase,
            "parts": [{"what": label, "bytes": size} for label, size in self.parts],
            "inside": [{"what": label, "bytes": size} for label, size in self.inside],
        }

    def table(self) -> Table:
        table = Table(title=f"Live at the memory peak ({self.phase}: {self.where or '-'})")
        table.add_column("what", overflow="fold", ratio=1)
        table.add_column("bytes", justify="right", no_wrap=True)
        for label, size in self.parts[:SHOWN]:
            table.add_row(label, format_bytes(size))
            if label == self.where:
                for op, op_size in self.inside:
                    short = op.removeprefix(label)
                    table.add_row(f"  of which ...{short}", format_bytes(op_size), style="dim")
        rest = self.parts[SHOWN:]
        if rest:
            table.add_row(f"{len(rest)} more", format_bytes(sum(s for _, s in rest)))
        table.add_row("live at the peak (XLA's count)", format_bytes(self.live_bytes))
        if self.allocated_bytes:
            table.add_row("allocated (memory_analysis)", format_bytes(self.allocated_bytes))
        if self.packing_bytes:
            table.add_row("allocated beyond it (packing)", format_bytes(self.packing_bytes))
        return table


def dump_options(directory: str | Path) -> dict[str, str]:
    """Per-compile options that make XLA write the module's buffer assignment and live
    ranges (with the peak breakdown) to ``directory``: ``lowered.compile(options)``."""
    return {"xla_dump_to": str(directory)}


def parse(text: str) -> Peak | None:
    """The peak breakdown of a ``*-live-range.txt`` dump (None when it has none)."""
    if HEADER not in text:
        return None
    lines = text.split(HEADER, 1)[1].splitlines()
    live = int(lines[0].replace("bytes", "").replace(" ", ""))
    entries = [
        (len(m.group("indent")), m.group("label"), int(m.group("total").replace(" ", "")))
        for line in lines[1:]
        if (m := _LINE.match(line))
    ]
    parts: dict[str, int] = {}
    inner: dict[str, dict[str, int]] = {}  # a part's leaf operations (a loop's body ops)
    top = ""
    for i, (depth, label, size) in enumerate(entries[1:], 1):  # entries[0]: the entry computation
        if depth == entries[1][0]:  # its direct parts, not what they are made of
            top = _group(label)
            parts[top] = parts.get(top, 0) + size
        elif "/" in label and (i + 1 == len(entries) or entries[i + 1][0] <= depth):
            leaves = inner.setdefault(top, {})
            leaves[label] = leaves.get(label, 0) + size
    peak = Peak(live_bytes=live, parts=tuple(sorted(parts.items(), key=lambda item: -item[1])))
    inside = sorted(inner.get(peak.where, {}).items(), key=lambda item: -item[1])
    return dataclasses.replace(peak, inside=tuple(inside[:INSIDE]))


def _group(label: str) -> str:
    """One line per argument tree and per kind of unnamed buffer: XLA lists the optimizer
    state leaf by leaf (``state['opt_state'][1][0].mu['embedding']``) and copies it makes
    by instruction name (``copy.224``)."""
    if "/" in label:  # a JAX operation path
        return label
    if _UNNAMED.match(label):
        return UNNAMED
    argument = _ARGUMENT.match(label)
    return argument.group(0) if argument else label


def read(directory: str | Path, allocated_bytes: int = 0) -> Peak | None:
    """The peak breakdown XLA dumped into ``directory`` (None when the backend wrote no
    live ranges: not every backend dumps them)."""
    files = sorted(Path(directory).glob("*after_optimizations-live-range.txt"))
    for path in reversed(files):  # the last module compiled: the step
        peak = parse(path.read_text())
        if peak is not None:
            return dataclasses.replace(peak, allocated_bytes=allocated_bytes)
    return None
