"""The IR: what every layer reads of a compiled job, as data.

Placements, the graph's metadata keys with typed accessors, the mesh and its axes, the
step program and its collectives, and the dataclasses the passes attach to the graph.
"""
