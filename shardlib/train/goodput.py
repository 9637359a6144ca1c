"""Goodput: the share of a run's wall time spent on steps that count.

Wall time is measured from the start of the run's first attempt (carried across restarts
by the ``metrics.jsonl`` records) and split into the productive step time and everything
else: start-up (initialisation or restore), compilation, checkpoint saves, waiting for data, and
the steps an attempt ran after its last checkpoint, which the next attempt runs again
(``redone``). The time between attempts (the job queue) counts as wall time too: goodput
is what the accelerators' owner pays for, per Google's ML Goodput definition.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Goodput:
    """Seconds by category; ``record()`` gives the running totals for a step's record."""

    started_at: float = field(default_factory=time.time)
    """Unix time the run's first attempt started."""
    productive_s: float = 0.0
    startup_s: float = 0.0
    """Initialisation or restore, before compilation."""
    compile_s: float = 0.0
    checkpoint_s: float = 0.0
    data_s: float = 0.0
    redone_s: float = 0.0
    """Step time of an earlier attempt's steps after its last checkpoint."""

    @classmethod
    def resumed(cls, previous: list[dict], start: int, now: float) -> Goodput:
        """Totals carried over from an earlier attempt's records, resuming at ``start``
        (without them, the run is counted from ``now``)."""
        if not previous or "started_at" not in previous[0]:
            return cls(started_at=now)
        kept = [r for r in previous if r.get("step", 0) <= start]
        redone = [r for r in previous if r.get("step", 0) > start]
        last = kept[-1] if kept else {}
        return cls(
            started_at=float(previous[0]["started_at"]),
            productive_s=float(last.get("productive_s", 0.0)),
            startup_s=float(last.get("startup_s", 0.0)),
            compile_s=float(last.get("compile_s", 0.0)),
            checkpoint_s=float(last.get("checkpoint_s", 0.0)),
            data_s=float(last.get("data_s", 0.0)),
            redone_s=float(last.get("redone_s", 0.0))
            + sum(float(r.get("step_time_s", 0.0)) for r in redone),
        )

    def record(self) -> dict:
        wall = max(time.time() - self.started_at, 1e-9)
        return {
            "started_at": self.started_at,
            "wall_s": wall,
            "productive_s": self.productive_s,
            "startup_s": self.startup_s,
            "compile_s": self.compile_s,
            "checkpoint_s": self.checkpoint_s,
            "data_s": self.data_s,
            "redone_s": self.redone_s,
            "goodput": self.productive_s / wall,
        }
