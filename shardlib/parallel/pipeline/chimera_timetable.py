"""Who runs what when in the Chimera schedule of ``pipeline/chimera.py``.

Chimera (Li and Hoefler, SC21) runs two pipelines over the same p devices: the *down*
pipeline's stage s on device s, the *up* pipeline's stage s on device p-1-s, m/2
micro-batches each (micro-batches 0..m/2-1 down, m/2..m-1 up). Here a loop trip gives
every device one forward slot and one backward slot (the lockstep form of ``timetable``'s
1F1B), and a device's direction alternates with the parity of the trip:

* down micro-batch j runs its forward on device s at trip s + 2j, its backward at
  2p-2-s + 2j (device p-1 turns around in the trip of its forward, after the head);
* up micro-batch j runs its forward on device s at trip p-1-s + 2j, its backward at
  p-1+s + 2j (device 0 turns around).

For even p, t - s and t - (p-1-s) have different parities, so no device is asked for two
forwards (or two backwards) in a trip, and every hand-over is consumed in the next trip:
forward outputs ``roll(+1)`` (down) and ``roll(-1)`` (up), cotangents the other way. Both
directions share one ring of 2p - 1 saved-input slots (slot = forward trip mod 2p - 1):
an input lives at most 2p - 2 trips (down on device 0, up on device p-1), as in 1F1B.

Trips: warm-up p - 1 (forwards only), steady m - 1 (both), cool-down p - 1 (backwards
only), m + 2p - 3 in all. Each device executes m + p - 2 forwards and backwards for m
useful ones: bubble (p-2)/m of the useful work, one trip less per kind than 1F1B's (p-1)/m.
The paper's (D-2)/(2N+D-2) counts single F or B units that a device may run in any order
(a backward fills a forward's idle slot); a lockstep trip has a static kind (its forward
and backward bodies run on every device), so the warm-up's idle backward slots and the
cool-down's idle forward slots stay empty: (p-2)/(m+p-2) of the executed work here.

No lockstep schedule does better. Its compiled forward work is its number of forward trips
(every device runs the forward body in each), and the fewest forward trips that fit every
item's p stages in order, one forward per device and trip, is m + p - 2: an integer program
over which trip runs each (item, stage), hand-overs even allowed to wait, solved to
optimality for (p, m) = (4, 4), (4, 8), (6, 6), (6, 12), (8, 8) with an
MILP solver (PuLP's CBC): 6, 10, 10, 16, 14 trips, each m + p - 2.
The paper's count needs devices that run a forward and a backward in the same time slot,
which one SPMD loop body can only give by computing both.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from shardlib.parallel.pipeline.timetable import Phases

DOWN, UP = 0, 1  # direction = the chunk a device runs: its down stage s or up stage p-1-s


@dataclass(frozen=True)
class Items:
    """Per device [p]: whether it has work, its direction (chunk), micro-batch, ring slot."""

    live: jnp.ndarray
    direction: jnp.ndarray
    micro: jnp.ndarray
    slot: jnp.ndarray


@dataclass(frozen=True)
class ChimeraSchedule(Phases):
    p: int
    m: int

    @property
    def half(self) -> int:
        """Micro-batches per direction."""
        return self.m // 2

    @property
    def ring_slots(self) -> int:
        """2p - 1: a saved input lives at most 2p - 2 trips after its forward."""
        return 2 * self.p - 1

    @property
    def warmup(self) -> int:
        """Forward-only trips before the first backward (and backward-only after the last
        forward): p - 1."""
        return self.p - 1

    @property
    def steady(self) -> int:
        """Trips with both a forward and a backward: m - 1."""
        return self.m - 1

    def heads(self, t: int) -> bool:
        """Whether trip t finishes micro-batches (down on device p-1, up on device 0)."""
        u = t - (self.p - 1)
        return u >= 0 and u % 2 == 0 and u // 2 < self.half

    def direction(self, t, xp=jnp):
        """[p]: the chunk every device runs in trip t, its forward's and its backward's alike
        (DOWN where t - s is even): a down item's backward on device s comes 2(p-1-s) trips
        after its forward there, an up item's 2s, both even, and the two directions'
        parities differ (even p). So a trip reads one chunk of the two a device holds."""
        return xp.where((t - xp.arange(self.p)) % 2 == 0, DOWN, UP)

    def _items(self, u_down, u_up, slot_down, slot_up, xp) -> Items:
        down = u_down % 2 == 0  # else the up item's parity (even p)
        u = xp.where(down, u_down, u_up)
        j = u // 2
        live = (u >= 0) & (j < self.half)
        micro = xp.clip(j, 0, self.half - 1) + xp.where(down, 0, self.half)
        slot = xp.where(down, slot_down, slot_up) % self.ring_slots
        return Items(live, xp.where(down, DOWN, UP), micro, slot)

    def forward(self, t, xp=jnp) -> Items:
        """Forward items at trip t; ``slot`` is where the stage input is saved. ``xp``:
        ``jax.numpy`` for the loop's traced t, ``numpy`` to simulate the schedule."""
        s = xp.arange(self.p)
        return self._items(t - s, t - (self.p - 1 - s), t + 0 * s, t + 0 * s, xp)

    def backward(self, t, xp=jnp) -> Items:
        """Backward items at trip t; ``slot`` is where their forward saved the input."""
        p, s = self.p, xp.arange(self.p)
        # forward trips of the same items: down s + 2j = t - (2p-2-2s), up p-1-s + 2j = t - 2s
        return self._items(t - (2 * p - 2 - s), t - (p - 1 + s), t - (2 * p - 2 - 2 * s),
                           t - 2 * s, xp)  # fmt: skip
