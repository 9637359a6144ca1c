"""A restart with the persistent compilation cache: compile seconds before and after.

Runs the README's default training run twice in fresh processes with one empty cache
directory (``run.compile_cache``), then once more with the cache off, and prints the
compile time each start paid (``compile_s`` of the metrics records):

    python benchmarks/compile_cache.py [--mesh MESH] [setting=value ...]

Without ``--mesh`` it runs on one CPU device: on CPU with more than one device shardlib
keeps the cache off (executables loaded from it can deadlock in XLA's in-process
collectives; see ``shardlib/train/profiling.py``), so there is nothing to measure there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table


def start(mesh: str, cache: str, metrics: Path, settings: list[str]) -> float:
    """Compile seconds of one fresh-process start of the run."""
    command = [sys.executable, "-m", "shardlib.tools.cli", "train", "--mesh", mesh, "steps=2"]
    command += [f"compile_cache={cache}", f"metrics={metrics}", *settings]
    subprocess.run(command, check=True, capture_output=True, text=True)
    first = json.loads(metrics.read_text().splitlines()[0])
    return float(first["compile_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mesh", default=None, help="mesh preset (default: one CPU device)")
    parser.add_argument("settings", nargs="*", help="training settings, e.g. model.layers=4")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        label = args.mesh or "one CPU device"
        if args.mesh is None:
            args.mesh = str(tmp / "cpu-1.toml")
            Path(args.mesh).write_text('platform = "cpu"\n\n[mesh]\ndata = 1\n')
        cache = str(tmp / "cache")
        rows = [
            ("cache off", start(args.mesh, "off", tmp / "off.jsonl", args.settings)),
            ("first start, empty cache", start(args.mesh, cache, tmp / "a.jsonl", args.settings)),
            ("restart, same cache", start(args.mesh, cache, tmp / "b.jsonl", args.settings)),
        ]
    table = Table(title=f"compilation of the train step ({label})")
    table.add_column("start")
    table.add_column("compile s", justify="right")
    for name, seconds in rows:
        table.add_row(name, f"{seconds:.2f}")
    console = Console()
    console.print(table)
    saved = rows[1][1] - rows[2][1]
    console.print(f"the cache saves {saved:.2f} s per restart ({saved / rows[1][1]:.0%})")


if __name__ == "__main__":
    main()
