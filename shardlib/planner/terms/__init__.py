"""One small module per strategy's cost: memory it adds, collectives it runs, FLOPs it adds.

``state`` (parameters, gradients, optimizer state under every split), ``model`` (FLOPs and
saved activations), ``dp``, ``fsdp``, ``tensor``, ``context``, ``expert`` (checked against
compiled programs), ``pipeline``, ``remat``, ``offload`` (formula-only until their
strategies land). ``planner.cost`` adds them up.
"""
