"""The XLA flags every test process runs with, in one place (conftest and the subprocesses
tests start share them, so a loss computed here and one computed in a child process come
from the same machine code and compare bit for bit).

``FAST_COMPILE`` skips LLVM's backend optimisations: the optimised HLO, buffer assignment
and so every memory, FLOP and collective figure a test reads stay the same, while compiles
take about a third less time (``tests/parallel/test_parity.py -k "dp8 or tp8 or 3d"``, one process:
77 s -> 50 s). The tests' programs are tiny, so the slower machine code costs little.
"""

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
