"""Mesh presets (``*.toml``, each a ``ParallelPlan``) and hardware presets (``clusters/*.toml``).

Data, not code: a package only so that ``pip install`` ships the files and
``shardlib.core.mesh.load_mesh("cpu-8-3d")`` finds them from any working directory.
"""
