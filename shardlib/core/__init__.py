"""The bottom layer: errors, typed values, meshes, rules, layouts, the model protocol, the ops
models call, and the description of a model and its step. Imports nothing else from shardlib."""
