"""Fake devices for the whole suite, set up in one place.

XLA reads ``--xla_force_host_platform_device_count`` once, when the CPU backend starts, so
it must be set before anything imports JAX. Every test sees 8 CPU devices; a test that
needs fewer builds a mesh over ``jax.devices()[:n]``.
"""

import os

from xla_test_flags import FAST_COMPILE

os.environ["XLA_FLAGS"] = (
    f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
