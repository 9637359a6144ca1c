"""Benchmarks, and the programs and formulas they share with the tests.

Each benchmark is a script (``python benchmarks/pipeline.py``); the ones that import their
siblings put the repository root on ``sys.path`` themselves, and the tests import the
shared modules as ``benchmarks.<name>``.
"""
