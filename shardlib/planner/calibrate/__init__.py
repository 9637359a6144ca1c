"""Fitting and checking the cost model: probes fitted to compiled programs (``fit``) and
Megatron-LM's published program (``megatron``)."""
