"""The compiler: a capture and a plan become a `Program`, the whole job as data.

The pass list, the pipeline cut, and the lowering of every rank to its step program.
"""
