"""Planner search: speed on a 70B model over 512 devices, and exactness against exhaustive.

    python benchmarks/planner_search.py

Prints, for each (model, cluster) pair, the plan ``search`` picks, the plan exhaustive
enumeration under the same cost model picks, how many plans each costed, and the wall time.
What it checks: the same optimum for every pair, and llama-70b on 512 devices in < 60 s.
"""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.table import Table

from shardlib.planner import PlanView, Workload, load_cluster
from shardlib.planner.search import Space, exhaustive, rank_key, search

PAIRS = [  # (model, global batch, seq, cluster, hosts, exhaustive too)
    ("llama-7b", 256, 2048, "h100-8", None, True),
    ("llama-1b", 512, 4096, "a100-8", None, True),
    ("llama-7b", 512, 4096, "tpu-v5p-128", None, True),
    ("llama-70b", 256, 4096, "h100-512", 8, True),
    ("llama-70b", 1024, 4096, "h100-512", None, False),
]


def _text(plan) -> str:
    view = PlanView(plan)
    return f"{view.mesh_text()} {view.knobs_text()}"


def main() -> int:
    table = Table(title="search vs exhaustive enumeration (same cost model, full space)")
    for col in (
        "model",
        "devices",
        "search: best plan",
        "step",
        "costed",
        "time",
        "exhaustive: best",
        "costed",
        "time",
        "same",
    ):
        table.add_column(col, justify="left" if "plan" in col or "best" in col else "right")
    ok = True
    for model, batch, seq, name, hosts, check in PAIRS:
        cluster = load_cluster(name)
        cluster = cluster.with_hosts(hosts) if hosts else cluster
        w = Workload.from_preset(model, batch, seq)
        start = time.perf_counter()
        fast = search(w, cluster, Space(), top=5)
        t_fast = time.perf_counter() - start
        row = [model, str(cluster.num_devices)]
        best = fast.best[0]
        row += [
            _text(best.plan),
            f"{best.step_s:.3f} s",
            str(fast.evaluated),
            f"{t_fast:.1f} s",
        ]
        if check:
            start = time.perf_counter()
            full = exhaustive(w, cluster, Space())
            t_full = time.perf_counter() - start
            same = rank_key(full.best[0]) == rank_key(best)
            ok &= same
            row += [
                _text(full.best[0].plan),
                str(full.evaluated),
                f"{t_full:.1f} s",
                "yes" if same else "NO",
            ]
        else:
            row += ["(not run: too large)", "-", "-", "-"]
            ok &= t_fast < 60
        table.add_row(*row)
    Console(width=220).print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
