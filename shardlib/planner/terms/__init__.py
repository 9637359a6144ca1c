"""One small module per strategy's cost: memory it adds, collectives it runs, FLOPs it adds.

``state`` (parameters, gradients, optimizer state under every split), ``model`` (FLOPs and
saved activations), ``dp`` (with ZeRO-1/2), ``fsdp``, ``tensor``, ``context``, ``expert``,
``pipeline``, ``remat``, ``offload``: each describes what the trainer's compiled program
does, and ``benchmarks/planner_validation.py`` checks them against compiled executables.
``planner.cost`` adds them up.
"""
