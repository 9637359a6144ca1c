"""Fake devices for the whole suite, set up in one place.

XLA reads ``--xla_force_host_platform_device_count`` once, when the CPU backend starts, so
it must be set before anything imports JAX. Every test sees 8 CPU devices; a test that
needs fewer builds a mesh over ``jax.devices()[:n]``.
"""

import gc
import os

from xla_test_flags import FAST_COMPILE

# Tracing a program makes millions of short-lived Python objects; the cyclic collector's
# default (a pass every 700 net allocations) spends a tenth of a pipeline test's time walking
# them (tests/parallel/test_pipeline_composition.py in one process, run side by side with
# and without, twice: user time 60.7 -> 53.9 s and 59.7 -> 56.0 s). Collected less often, not
# never; the objects alive at start-up (jax, flax, shardlib) are left out of every pass.
gc.freeze()
gc.set_threshold(100_000, 50, 100)

os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The test files that take longest (tens of seconds each on a 2-core CI machine), started
# first. pytest-xdist's ``--dist loadfile`` hands whole files to the workers in collection
# order (``--no-loadscope-reorder``: else it sorts them by test count, which puts these
# few-test, long files last, each then running alone while the other worker idles).
LONGEST_FIRST = (  # seconds of test time in CI (2 cores), longest first
    "tests/parallel/test_pipeline.py",  # ~95
    "tests/distributed/test_faults_multiprocess.py",  # ~85
    "tests/parallel/test_loss.py",  # ~78
    "tests/tools/test_notebooks.py",  # ~70 (notebook 02: 44)
    "tests/interop/test_deepspeed_configs.py",  # ~62
    "tests/distributed/test_multiprocess.py",  # ~52
    "tests/parallel/test_pipeline_stages.py",  # ~42
)


def pytest_collection_modifyitems(config, items):
    """Longest files first (``LONGEST_FIRST``), then the other files with slow tests, then
    the rest, each file's tests in their own order: the quick files fill the last gaps."""
    slow = {item.nodeid.split("::")[0] for item in items if item.get_closest_marker("slow")}

    def rank(item) -> int:
        path = item.nodeid.split("::")[0]
        if path in LONGEST_FIRST:
            return LONGEST_FIRST.index(path)
        return len(LONGEST_FIRST) + (path not in slow)

    items.sort(key=rank)  # stable: collection order within each rank
