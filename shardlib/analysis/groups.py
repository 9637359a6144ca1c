"""Replica groups and source-target pairs of collectives, in every printed form.

Split from ``hlo.py`` because the group syntaxes alone (explicit lists, iota, Shardy's mesh
form with device orders and sub-axes) are as large as the rest of the parser. Pure text ->
arrays of device positions (indices into the compiled device assignment).
"""

from __future__ import annotations

import math
import re

import numpy as np

_OUTSIDE = re.compile(r'["()\[\]{}]')  # what changes the depth, or opens a string
_INSIDE = re.compile(r'[\\"]')  # what escapes or closes a string


def close_bracket(text: str, start: int) -> int:
    """Index just past the bracket that closes ``text[start]``, skipping quoted strings.

    Jumps from bracket to bracket with a regex, not character by character: optimized HLO
    lines carry long metadata strings, and ``compiled_flops`` parses every run's program."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack, i = [], start
    while (m := _OUTSIDE.search(text, i)) is not None:
        c, i = m.group(), m.end()
        if c == '"':
            while (q := _INSIDE.search(text, i)) is not None:
                i = q.end() + (q.group() == "\\")  # an escape skips the next character
                if q.group() == '"':
                    break
            else:
                return len(text)
        elif c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i
    return len(text)


def _iota_groups(text: str) -> np.ndarray | None:
    """``[G,S]<=[dims]T(perm)`` -> an int array of shape [G, S]."""
    m = re.match(r"\[([\d,\s]+)\]<=\[([\d,\s]+)\](?:T\(([\d,\s]+)\))?", text)
    if not m:
        return None
    shape = [int(x) for x in m.group(1).split(",")]
    dims = [int(x) for x in m.group(2).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(x) for x in m.group(3).split(",")])
    return ids.reshape(shape)


def _mesh_groups(text: str) -> np.ndarray | None:
    """Shardy-style groups: ``mesh['a'=2,'b'=4] {'b'}`` or ``@mesh<a=2,b=4>(devices=..) {b}``.

    Members of one group differ only along the listed axes (or sub-axes ``b:(pre)size``,
    where an axis of size n is split major-to-minor into [pre, size, n / (pre * size)]).
    """
    m = re.match(r"@?mesh\s*[\[<]([^\]>]*)[\]>]", text)
    if not m:
        return None
    axes = [a.split("=") for a in m.group(1).replace("'", "").replace('"', "").split(",")]
    names = [a[0].strip() for a in axes]
    sizes = [int(a[1]) for a in axes]
    rest = text[m.end() :]
    ids = np.arange(math.prod(sizes))
    dev = re.match(r"\s*,?\s*(?:device_ids=)?\(", rest)
    if dev:  # a non-iota device order, printed in parentheses after the axes
        end = close_bracket(rest, dev.end() - 1)
        spec = rest[dev.end() : end - 1].removeprefix("devices=")
        iota = _iota_groups(spec)
        short = re.fullmatch(r"\s*\[([\d,\s]+)\]\s*(?:T\(([\d,\s]+)\))?\s*", spec)
        if iota is not None:
            ids = iota.reshape(-1)
        elif short:  # ``[2,4]T(1,0)``: an iota over the dims, transposed
            dims = [int(d) for d in short.group(1).split(",")]
            perm = [int(p) for p in short.group(2).split(",")] if short.group(2) else None
            ids = np.arange(math.prod(dims)).reshape(dims).transpose(perm).reshape(-1)
        else:
            listed = spec.split("]", 1)[-1] if spec.startswith("[") else spec
            ids = np.array(re.findall(r"\d+", listed), int)
        rest = rest[end:]
    ids = ids.reshape(sizes)
    selected = re.match(r"\s*\{([^}]*)\}", rest)
    refs = [r.strip().replace("'", "") for r in (selected.group(1) if selected else "").split(",")]
    keys = np.array(np.unravel_index(np.arange(ids.size), sizes)).T  # [devices, axes]
    for ref in filter(None, refs):
        sub = re.match(r"([^:]+):\((\d+)\)(\d+)", ref)
        axis = names.index(sub.group(1) if sub else ref)
        n = sizes[axis]
        if sub:
            pre, size = int(sub.group(2)), int(sub.group(3))
            minor = n // (pre * size)
            keys[:, axis] -= (keys[:, axis] // minor) % size * minor
        else:
            keys[:, axis] = 0
    groups: dict[tuple[int, ...], list[int]] = {}
    for device, key in zip(ids.reshape(-1), map(tuple, keys), strict=True):
        groups.setdefault(key, []).append(int(device))
    return np.array(list(groups.values()))


def parse_replica_groups(attrs: str, num_devices: int) -> list[list[int]] | None:
    """Device groups of a collective's ``replica_groups=``; None if the attribute is absent.

    Three printed forms: explicit ``{{0,1},{2,3}}`` (``{}`` = every device in one group), iota
    ``[2,4]<=[8]`` / ``[4,2]<=[2,4]T(1,0)``, and Shardy's mesh form (``_mesh_groups``). The
    ids are global device ids (``use_global_device_ids``) or partition ids; with one replica,
    as jit produces, both are the index into the compiled device assignment.
    """
    m = re.search(r"\breplica_groups=", attrs)
    if not m:
        return None
    rest = attrs[m.end() :]
    if rest.startswith("{"):
        inner = rest[1 : close_bracket(rest, 0) - 1]
        groups = [
            [int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([^{}]*)\}", inner)
        ]
        groups = [g for g in groups if g]
        return groups or [list(range(num_devices))]
    array = _iota_groups(rest)
    if array is None:
        array = _mesh_groups(rest)
    if array is None:
        raise ValueError(f"unrecognised replica_groups: {rest[:80]!r}")
    return array.tolist()


def parse_source_target_pairs(attrs: str) -> list[tuple[int, int]]:
    """``source_target_pairs={{0,1},{1,2}}`` -> [(0, 1), (1, 2)]."""
    m = re.search(r"source_target_pairs=\{", attrs)
    if not m:
        return []
    rest = attrs[m.end() - 1 :]
    inner = rest[: close_bracket(rest, 0)]
    return [(int(a), int(b)) for a, b in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", inner)]
