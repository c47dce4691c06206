"""What a rank holds and updates: gradient buckets, ZeRO's gathers and shards, master
weights, and the optimizers that step them.
"""
