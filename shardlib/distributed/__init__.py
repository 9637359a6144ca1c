"""Multi-process runs: JAX's runtime (``runtime``), who may join (``admission``), peers that
fail together (``peers``) and stopping on a signal at one step boundary (``preempt``)."""
