"""The plan: which parallelism fxpar applies, its text and file forms, and its checks.
"""
