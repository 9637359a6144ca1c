"""Rendering of a ShardingPicture: a matplotlib Figure and a rich text version.

Kept apart from ``shardlib.analysis.picture`` so that describing a layout never imports matplotlib.
The array is drawn one panel per slice of its leading dims (rank 3 ``[batch, seq, embed]``:
one ``seq x embed`` panel per batch tile), each tile coloured and labelled with the devices
that hold it; beside it the device mesh, every device coloured by the tile it holds.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rich.console import Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from shardlib.analysis.picture import ShardingPicture, Tile


_PALETTES = ("Set3", "Pastel1", "Pastel2")


def tile_colors(n: int) -> list[tuple[float, float, float]]:
    """``n`` light colours (black text stays readable), cycling past 29."""
    from matplotlib import colormaps

    base = [c[:3] for name in _PALETTES for c in colormaps[name].colors]
    return [base[i % len(base)] for i in range(n)]


def _hex(rgb: tuple[float, float, float]) -> str:
    return "#" + "".join(f"{round(255 * v):02x}" for v in rgb)


_LISTED = 8
"""Tiles held by more devices than this are labelled with the first ids and the count."""


def device_list(ids: tuple[int, ...]) -> str:
    """(0, 4) -> '0,4'; (0, 1) -> '0,1': one style for every tile, ids in order.

    Runs were once collapsed ('0-1') while strided sets were not ('0,4'), so two labels of
    one picture read differently; a long set keeps its first ids and says how many there are.
    """
    ids = sorted(ids)
    if len(ids) <= _LISTED:
        return ",".join(map(str, ids))
    return ",".join(map(str, ids[: _LISTED - 2])) + f",… ({len(ids)})"


def panels(pic: ShardingPicture) -> list[tuple[str, list[tuple[int, Tile]]]]:
    """Tiles grouped by their bounds on the leading dims (all but the last two)."""
    lead = max(len(pic.shape) - 2, 0)
    groups: dict[tuple, list[tuple[int, Tile]]] = {}
    for i, tile in enumerate(pic.tiles):
        groups.setdefault(tile.bounds[:lead], []).append((i, tile))
    out = []
    for key, tiles in sorted(groups.items()):
        label = ", ".join(f"{pic.dims[d].label} {a}:{b}" for d, (a, b) in enumerate(key))
        out.append((label, tiles))
    return out


def _plane(pic: ShardingPicture, tile: Tile) -> tuple[float, float, float, float]:
    """(x0, x1, y0, y1) of a tile in a unit square: x = last dim, y = the one before."""
    rank = len(pic.shape)
    if rank == 0:
        return 0.0, 1.0, 0.0, 1.0
    (a, b), n = tile.bounds[-1], pic.shape[-1]
    x0, x1 = a / n, b / n
    if rank == 1:
        return x0, x1, 0.0, 1.0
    (c, d), m = tile.bounds[-2], pic.shape[-2]
    return x0, x1, c / m, d / m


def draw_figure(pic: ShardingPicture, max_panels: int = 8):
    """The Figure described in the module docstring (no pyplot state is touched)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    groups = panels(pic)
    shown = groups[:max_panels]
    colors = tile_colors(len(pic.tiles))
    cols = min(len(shown), 4)
    rows = math.ceil(len(shown) / cols)
    has_mesh = bool(pic.mesh_axes)
    lines = pic.describe()
    if len(groups) > len(shown):
        lines.append(f"(first {len(shown)} of {len(groups)} slices of the leading dims shown)")
    panel_w, panel_h = (3.0, 2.7) if len(shown) <= 2 else (2.1, 1.9)
    width = panel_w * cols + (2.8 if has_mesh else 0)
    height = panel_h * rows + 0.22 * len(lines)
    fig = Figure(figsize=(max(width, 6.0), height), layout="constrained")
    grid = fig.add_gridspec(rows, cols + has_mesh, width_ratios=[panel_w] * cols + [2.8] * has_mesh)
    fig.suptitle("\n".join(lines), x=0.01, ha="left", fontsize=8.5, family="monospace")

    per_panel = max(len(t) for _, t in shown)
    font = 9 if per_panel <= 8 else 7 if per_panel <= 32 else 5
    for k, (label, tiles) in enumerate(shown):
        ax = fig.add_subplot(grid[k // cols, k % cols])
        for i, tile in tiles:
            x0, x1, y0, y1 = _plane(pic, tile)
            ax.add_patch(Rectangle((x0, y0), x1 - x0, y1 - y0, fc=colors[i], ec="black", lw=1))
            text = f"dev {device_list(tile.devices)}"
            narrow = (x1 - x0) * panel_w < 0.12 * len(text) * font / 9 and y1 - y0 > x1 - x0
            ax.text(
                (x0 + x1) / 2,
                (y0 + y1) / 2,
                text,
                ha="center",
                va="center",
                fontsize=font,
                rotation=90 if narrow else 0,
            )
        ax.set_xlim(0, 1)
        ax.set_ylim(1, 0)  # row 0 at the top, like a matrix
        ax.set_xticks([])
        ax.set_yticks([])
        if label:
            ax.set_title(label, fontsize=8)
        if pic.dims:
            ax.set_xlabel(pic.dims[-1].short(), fontsize=8)
        if len(pic.dims) >= 2 and k % cols == 0:
            ax.set_ylabel(pic.dims[-2].short(), fontsize=8)
    if has_mesh:
        _draw_mesh(fig.add_subplot(grid[:, cols]), pic, colors)
    return fig


def mesh_grid(pic: ShardingPicture) -> tuple[list[list[int]], str, str]:
    """Device ids as rows x columns: rows = the first mesh axis, columns = the others.

    A mesh of three or more axes is folded into 2D by flattening the later axes into the
    columns in row-major order (the last axis varies fastest); the column label says so,
    e.g. ``fsdp (2) × tensor (2), column = fsdp·2 + tensor``.
    """
    (first, n0), rest = pic.mesh_axes[0], pic.mesh_axes[1:]
    if not rest:  # a 1D mesh is one row
        return [list(pic.mesh_device_ids)], "", f"{first} ({n0})"
    cols = math.prod(s for _, s in rest)
    ids = list(pic.mesh_device_ids)
    grid = [ids[r * cols : (r + 1) * cols] for r in range(n0)]
    xlabel = " × ".join(f"{n} ({s})" for n, s in rest)
    if len(rest) > 1:
        terms = [
            name + "".join(f"·{s}" for _, s in rest[i + 1 :]) for i, (name, _) in enumerate(rest)
        ]
        xlabel += ", column = " + " + ".join(terms)
    return grid, f"{first} ({n0})", xlabel


def _draw_mesh(ax, pic: ShardingPicture, colors) -> None:
    from matplotlib.patches import Rectangle

    grid, ylabel, xlabel = mesh_grid(pic)
    rows, cols = len(grid), len(grid[0])
    for r, row in enumerate(grid):
        for c, dev in enumerate(row):
            ax.add_patch(Rectangle((c, r), 1, 1, fc=colors[pic.tile_of(dev)], ec="black", lw=1))
            ax.text(c + 0.5, r + 0.5, str(dev), ha="center", va="center", fontsize=9)
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title("device mesh (colour = tile held)", fontsize=8)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)


def _cell(text: str, color: str) -> Padding:
    return Padding(Text(text, justify="center"), (0, 1), style=f"black on {color}", expand=True)


def rich_picture(pic: ShardingPicture) -> Group:
    """Coloured text: the description, one table per panel, and the mesh."""
    colors = [_hex(c) for c in tile_colors(len(pic.tiles))]
    parts: list = [Text(line) for line in pic.describe()]
    for label, tiles in panels(pic):
        row_keys = sorted({t.bounds[-2] if len(pic.shape) >= 2 else (0, 1) for _, t in tiles})
        col_keys = sorted({t.bounds[-1] if pic.shape else (0, 1) for _, t in tiles})
        title = label or None
        table = Table(show_header=False, show_lines=True, title=title, padding=0)
        for _ in col_keys:
            table.add_column(min_width=7)
        cells = {}
        for i, tile in tiles:
            r = tile.bounds[-2] if len(pic.shape) >= 2 else (0, 1)
            c = tile.bounds[-1] if pic.shape else (0, 1)
            cells[(r, c)] = _cell(f"dev {device_list(tile.devices)}", colors[i])
        for r in row_keys:
            table.add_row(*(cells[(r, c)] for c in col_keys))
        parts.append(table)
    if pic.mesh_axes:
        grid, ylabel, xlabel = mesh_grid(pic)
        # a line, not the table's title: a title wraps to the (narrow) width of the grid
        parts.append(Text(f"mesh: rows {ylabel}, cols {xlabel}" if ylabel else f"mesh: {xlabel}"))
        mesh = Table(show_header=False, show_lines=True, padding=0)
        for _ in grid[0]:
            mesh.add_column(min_width=4)
        for row in grid:
            mesh.add_row(*(_cell(str(d), colors[pic.tile_of(d)]) for d in row))
        parts.append(mesh)
    return Group(*parts)
