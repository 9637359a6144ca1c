"""Benchmarks, and the programs and formulas they share with the tests.

Run a benchmark from the repository root with the root on the path, e.g.
``PYTHONPATH=. python benchmarks/pipeline.py``.
"""
