"""Named scopes the library's programs carry, shared with the code that reads their HLO.

A scope name is a contract between a writer (a pipeline schedule, say) and a reader
(``shardlib.analysis``): it lives here, below both, so neither imports the other.
"""

ONE_TRIP_SCOPE = "one_trip"
"""A ``while`` run exactly once (``parallel.pipeline.one_f_one_b.one_trip``) that hides its body
from XLA's loop-invariant hoisting; ``analysis.hlo`` counts its body once, not per trip."""
