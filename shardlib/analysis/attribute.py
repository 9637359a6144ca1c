"""Which tensor a collective moves, and which line of the user's code asked for it.

The op column of a report once showed ``jvp()/dot_general``: true, and no help in finding
the weight an all-gather fetches. The optimized HLO holds two better clues:

* the entry computation's parameters carry the JAX argument path in their metadata
  (``op_name="state['params']['head']['kernel']"``); following a collective's operand back
  through layout-only ops (bitcast, copy, transpose, a fusion with one array operand, ...)
  to such a parameter names the input it moves (FSDP's weight gathers);
* every instruction's metadata points at a stack frame (``stack_frame_id=6``, resolved by
  the module's ``FileNames``/``FunctionNames``/``FileLocations``/``StackFrames`` tables, or
  ``source_file=``/``source_line=`` in older printers): the file, line and function that
  produced the value (a gradient all-reduce has no input to name, but it has a line).
"""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path

import shardlib.analysis.hlo as hlo

# Ops that only move or re-type data: the operand is the same tensor, laid out differently.
_LAYOUT_OPS = frozenset({
    "bitcast", "copy", "copy-start", "copy-done", "reshape", "convert", "transpose",
    "broadcast", "slice", "dynamic-slice", "get-tuple-element", "all-gather-start",
    "all-gather-done", "optimization-barrier",
})  # fmt: skip
_MAX_HOPS = 12


def arg_path(op_name: str) -> str:
    """``state['params']['head']['kernel']`` -> ``state.params.head.kernel``."""
    text = op_name.replace("\\'", "'").replace('\\"', '"')
    text = re.sub(r"\[['\"]([^'\"]*)['\"]\]", r".\1", text)
    return re.sub(r"\[(\d+)\]", r".\1", text).strip(".")


def moved_input(module: hlo.HloModule, computation: str, name: str) -> str:
    """The argument path of the entry parameter a collective's data comes from, or ""."""
    comp = module.computations[computation]
    if not comp.is_entry:
        return ""  # inside a loop body a parameter is the loop's carry, not an input
    by_name = {i.name: i for i in comp.instructions}
    inst = by_name.get(name)
    for _ in range(_MAX_HOPS):
        if inst is None or not inst.operands:
            return ""
        arrays = [o for o in inst.operands if o in by_name and _elements(by_name[o]) > 1]
        if len(arrays) != 1:
            return ""
        inst = by_name[arrays[0]]
        if inst.opcode == "parameter":
            m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', inst.attrs)
            return arg_path(m.group(1)) if m else ""
        if inst.opcode not in _LAYOUT_OPS and inst.opcode != "fusion":
            return ""
    return ""


def _elements(inst: hlo.Instruction) -> int:
    arrays = inst.arrays
    return sum(max(1, a.elements) for a in arrays) if arrays else 0


_INSTALLED = re.compile(r"[/\\](site-packages|dist-packages)[/\\]")
_SHARDLIB = str(Path(__file__).resolve().parents[1])  # shardlib's own ops are library too
_STDLIB = sysconfig.get_paths()["stdlib"]


def _library(path: str) -> bool:
    """Not the user's code: installed packages, shardlib, Python's standard library and
    frozen modules (``<frozen runpy>``: the frame that ran ``python -m``, which would
    otherwise be the "user" line of everything the CLI compiles outside the model)."""
    if path.startswith("<") or path.startswith(_STDLIB):
        return True
    return bool(_INSTALLED.search(path)) or path.startswith(_SHARDLIB)


def stack_frames(text: str) -> dict[int, str]:
    """``stack_frame_id`` -> ``file.py:42 in fn`` from the module's frame tables.

    The innermost frame is often inside a library (``linear.py:431 in Linear.__call__``);
    the frames are walked outwards to the first one in the user's own code, which says
    which of their layers asked for the op; without one, the innermost in shardlib (the
    trainer's step: ``step.py:88 in loss``), else the innermost of all.
    """
    tables: dict[str, dict[int, str]] = {}
    current = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        m = re.match(r"^(\d+) (.*)$", line)
        if current is None or not m:
            current = None
            continue
        current[int(m.group(1))] = m.group(2)
    paths = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
    funcs = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
    places: dict[int, tuple[str, str]] = {}  # location id -> (full path, "file.py:42 in fn")
    for k, v in tables.get("FileLocations", {}).items():
        ids = dict(re.findall(r"(\w+)=(\d+)", v))
        path = paths.get(int(ids.get("file_name_id", 0)), "?")
        func = funcs.get(int(ids.get("function_name_id", 0)), "?")
        places[k] = (path, f"{Path(path).name}:{ids.get('line', '?')} in {func}")
    frames: dict[int, tuple[int, int]] = {}  # frame id -> (location id, parent frame id)
    for k, v in tables.get("StackFrames", {}).items():
        ids = dict(re.findall(r"(\w+)=(\d+)", v))
        frames[k] = (int(ids.get("file_location_id", 0)), int(ids.get("parent_frame_id", 0)))
    # jaxlib 0.10 prints each parent one above its id (a root frame names itself); a table
    # where no frame names itself is read as printed.
    shift = 1 if any(parent == k for k, (_, parent) in frames.items()) else 0
    frames = {k: (loc, parent - shift) for k, (loc, parent) in frames.items()}
    out = {}
    for k in frames:
        chosen, ours, frame, seen = None, None, k, set()
        while frame in frames and frame not in seen:
            seen.add(frame)
            location, parent = frames[frame]
            if location in places:
                path, where = places[location]
                chosen = chosen or where  # innermost, the last fallback
                if path.startswith(_SHARDLIB):
                    ours = ours or where  # shardlib's own step (a CLI run has no user frame)
                if not _library(path):
                    chosen = ours = where
                    break
            frame = parent
        if ours or chosen:
            out[k] = ours or chosen
    return out


def source(inst_attrs: str, frames: dict[int, str]) -> str:
    """Where the instruction came from: ``file.py:42 in fn``, or "" when not recorded."""
    m = re.search(r"stack_frame_id=(\d+)", inst_attrs)
    if m and int(m.group(1)) in frames:
        return frames[int(m.group(1))]
    file = re.search(r'source_file="([^"]*)"', inst_attrs)
    line = re.search(r"source_line=(\d+)", inst_attrs)
    if file and line:
        return f"{Path(file.group(1)).name}:{line.group(1)}"
    return ""
