"""The top layer: the ``shardlib`` command line and what only it runs (generate, parity,
plan).
"""
