"""The XLA flags every test process runs with, in one place (conftest and the subprocesses
tests start share them, so a loss computed here and one computed in a child process come
from the same machine code and compare bit for bit).

``FAST_COMPILE`` makes the CPU backend's code generation cheaper; the SPMD partitioner, the
collectives, the HLO a test reads and buffer assignment are the same, only how each fused
kernel becomes machine code changes:

* ``--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true`` skip
  LLVM's backend optimisations (``tests/parallel/test_parity.py -k "dp8 or tp8 or 3d"``,
  one process: 77 s -> 50 s).
* ``--xla_cpu_use_fusion_emitters=false`` emits fusions with XLA's older elemental emitters
  instead of its MLIR fusion emitters, where jaxlib still has the choice (0.10; newer ones
  have only the MLIR emitters and abort on the flag, so it is probed, once per test run).
  Compiling llama-tiny's train step on 2 x 2 x 2: 3.3 s -> 1.1 s, 1F1B on stage 2 x data
  2 x tensor 2: 6.0 s -> 3.5 s. The fusions it forms differ slightly (224 against 263 on
  2 x 2 x 2), so temporary bytes move by a few hundred bytes (192 in 2.8 MB there, 832 in
  3.2 MB on ``test_planner.py``'s 3-layer plan: < 0.03%) and ``cost_analysis`` FLOPs by
  0.02%; collectives and parameter, argument and output bytes are unchanged. Not always
  so small: interleaved 1F1B on stage 2 x fsdp 2 x tensor 2 (llama-tiny, 4 layers) has
  about 5% fewer temporary bytes under it (planner / compiled 1.073 -> 1.129), so memory
  checks against the planner are made under XLA's defaults (``benchmarks/``).

The tests' programs are tiny, so the slower machine code costs little.
"""

import os
import subprocess
import sys

_ALWAYS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_IF_KNOWN = ("--xla_cpu_use_fusion_emitters=false",)
_PROBED = "SHARDLIB_TEST_FAST_COMPILE"  # the probe's answer, inherited by workers and children


def _known(flag: str) -> bool:
    """Whether this jaxlib's XLA accepts ``flag`` (XLA aborts at start-up on one it does not
    know, so a child process tries it)."""
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True).returncode == 0


def _fast_compile() -> str:
    if _PROBED not in os.environ:
        known = [flag for flag in _IF_KNOWN if _known(flag)]
        os.environ[_PROBED] = " ".join([_ALWAYS, *known])
    return os.environ[_PROBED]


FAST_COMPILE = _fast_compile()
