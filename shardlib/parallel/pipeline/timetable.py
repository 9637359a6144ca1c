"""Who runs what when in the (interleaved) 1F1B schedule of ``pipeline/one_f_one_b.py``.

p devices, v chunks (virtual stages r·p + s) per device, m micro-batches, vp = v·p. Work
items are numbered Megatron-style in groups of p micro-batches: item u of a device is
group g = u // vp, round r = (u mod vp) // p, micro-batch i = g·p + u mod p. At
iteration t device s runs forward item t - s and backward item t - (vp - 1) - (p-1-s),
whose round counts down (v-1 - (u mod vp) // p). Both are plain integer arithmetic on the
loop counter, so the same functions serve the jitted loop (traced ``t``) and the tests
(Python ints).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp


@dataclass(frozen=True)
class Items:
    """Per device [p]: whether it has work, its round (chunk), micro-batch, ring slot."""

    live: jnp.ndarray
    round: jnp.ndarray
    micro: jnp.ndarray
    slot: jnp.ndarray


class Phases:
    """A fused forward/backward loop's three phases, from its ``warmup`` (forward-only
    trips; as many backward-only ones close the loop) and ``steady`` (both) trip counts:
    1F1B's (``Schedule``) and Chimera's (``chimera_timetable``)."""

    warmup: int
    steady: int

    @property
    def cooldown_start(self) -> int:
        return self.warmup + self.steady

    @property
    def trips(self) -> int:
        """Loop trips of all three phases (1F1B: vm + vp + p - 2; Chimera: m + 2p - 3)."""
        return self.steady + 2 * self.warmup

    @property
    def executed(self) -> int:
        """Chunk forwards (and backwards) each device executes (1F1B: vm + p - 1; Chimera:
        m + p - 2), for the useful ones (vm; m)."""
        return self.steady + self.warmup


@dataclass(frozen=True)
class Schedule(Phases):
    p: int
    m: int
    v: int = 1

    @property
    def ring_slots(self) -> int:
        """R = 2vp - 1: a stage input lives at most 2vp - 2 iterations after its forward.
        (2vp - 2 slots would do if a trip's backward read its slot before the trip's forward
        wrote it, but the read is then a copy of the slot live through the forward: the
        same memory, measured on the 39B layout.)"""
        return 2 * self.v * self.p - 1

    @property
    def warmup(self) -> int:
        """Forward-only iterations before the first backward (and backward-only after the
        last forward): vp - 1."""
        return self.v * self.p - 1

    @property
    def steady(self) -> int:
        """Iterations with both a forward and a backward: vm + p - vp."""
        return self.v * self.m + self.p - self.v * self.p

    def heads(self, t: int) -> bool:
        """Whether device p-1 finishes round v-1 at trip t (the head and loss run then)."""
        u = t - (self.p - 1)
        return u >= 0 and (u % (self.v * self.p)) // self.p == self.v - 1

    def embeds(self, t: int) -> bool:
        """Whether device 0 runs a round-0 forward at trip t (the embedding runs then)."""
        return t >= 0 and t % (self.v * self.p) < self.p  # (after the last: masked, cheap)

    def embeds_grad(self, t: int) -> bool:
        """Whether device 0 runs a round-0 backward at trip t (the embedding's gradient)."""
        u = t - (self.v * self.p - 1) - (self.p - 1)
        return u >= 0 and (u % (self.v * self.p)) // self.p == self.v - 1

    def _split(self, u, xp):
        vp = self.v * self.p
        uc = xp.clip(u, 0, self.v * self.m - 1)
        return (u >= 0) & (u < self.v * self.m), uc // vp, (uc % vp) // self.p, uc % self.p

    def forward(self, t, xp=jnp) -> Items:
        """Forward items at iteration t; ``slot`` is where the stage input is saved.
        ``xp``: ``jax.numpy`` for the loop's traced t, ``numpy`` to simulate the schedule."""
        s = xp.arange(self.p)
        live, g, r, j = self._split(t - s, xp)
        return Items(live, r, g * self.p + j, xp.full_like(s, t % self.ring_slots))

    def backward(self, t, xp=jnp) -> Items:
        """Backward items at iteration t; ``slot`` is where their forward saved the input."""
        p, vp = self.p, self.v * self.p
        s = xp.arange(p)
        live, g, back, j = self._split(t - (vp - 1) - (p - 1 - s), xp)
        r = self.v - 1 - back
        t_forward = s + g * vp + r * p + j
        return Items(live, r, g * p + j, t_forward % self.ring_slots)
