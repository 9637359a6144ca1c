"""Processes that each read their own shards of a step agree on what became of it.

With several processes every process reads the slices it will hold (of its own copy, in the
local tier; of the shared step, in the persistent one) without orbax's cross-process
barriers (``store._reader``): a barrier that a process whose read failed never reaches
would hold the others. So the processes meet here instead, after each has read, at points
every process passes whatever it read: whether any of them failed (``any_process``), and
what the first that failed could not read (``first_said``), which process 0 prints.
"""

from __future__ import annotations

import jax
import numpy as np

SAID_BYTES = 512
"""Bytes of a message that ``first_said`` passes between processes."""


def any_process(flag: bool) -> bool:
    """``flag`` of any process (all call this): one branch for every process."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.asarray([flag], np.int32))  # [processes, 1]
    return bool(np.asarray(flags).any())


def first_said(text: str) -> str:
    """The lowest-ranked process's non-empty ``text`` ("" when none has one; all call this):
    how process 0, which prints, names what another process could not read."""
    if jax.process_count() == 1:
        return text
    from jax.experimental import multihost_utils

    raw = np.zeros(SAID_BYTES, np.uint8)  # [SAID_BYTES]
    data = text.encode()[:SAID_BYTES]
    raw[: len(data)] = np.frombuffer(data, np.uint8)
    every = np.asarray(multihost_utils.process_allgather(raw))  # [processes, SAID_BYTES]
    said = [bytes(row).rstrip(b"\0").decode(errors="replace") for row in every]
    return next((t for t in said if t), "")


def on_this_process() -> str:
    """`` on process I`` with several processes, else "": where a ``first_said`` came from."""
    return f" on process {jax.process_index()}" if jax.process_count() > 1 else ""
