"""Tensor parallelism: plan rules to placements, propagated op by op, every collective derived.
"""
