"""Walking a fused loop's timetable (1F1B's ``Schedule``, ``ChimeraSchedule``) trip by trip,
as the jitted loop runs it, for the tests that check who runs what when."""

import numpy as np


def walk(sched, p: int, key_value) -> dict:
    """``{key: value}`` of every live forward and backward item, ``key_value(kind, items,
    t, s) -> (key, value)`` for kind "f"/"b" on device s at trip t; asserts that no work
    falls outside its phase and no key comes twice."""
    phases = [
        (0, sched.warmup, True, False),
        (sched.warmup, sched.cooldown_start, True, True),
        (sched.cooldown_start, sched.trips, False, True),
    ]
    when = {}
    for start, end, fwd_on, bwd_on in phases:
        for t in range(start, end):
            for kind, on, items in (("f", fwd_on, sched.forward), ("b", bwd_on, sched.backward)):
                it = items(t, np)
                for s in range(p):
                    if bool(it.live[s]):
                        assert on, (kind, t, s, "work outside its phase")
                        key, value = key_value(kind, it, t, s)
                        assert key not in when, key
                        when[key] = value
    return when
