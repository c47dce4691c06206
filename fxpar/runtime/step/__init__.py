"""One training step at run time: the executors, the actions they run, and the checks
and agreements around them.
"""
