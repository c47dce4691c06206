"""Pictures of a compiled program: the partitioned graph (graphviz) and the charts (matplotlib).
"""
