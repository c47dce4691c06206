"""The operators a rank module calls: collectives on a named mesh axis, vocabulary-parallel
lookups, deferred linears, ZeRO-3's gathers and the random draws, registered as `torch.ops.fxpar.*`.
"""
