"""The runtime: binds a compiled Program to one torchrun worker.

    runner.py, binding.py    Runner (step, optimizer, comm_stats, save/load) and bind's one-time work
    environment.py           the torchrun variables and bind's timeout, checked
    process_groups.py        the default group and one group per mesh axis, each with a timeout
    communicator.py          every collective fxpar issues, counted, guarded, with clear failures
    step/                    one training step: the executors, the actions they run, the guard,
                             the step agreements and the batch checks
    state/                   what a rank holds and updates: gradient buckets, ZeRO's gathers and
                             shards, master weights, the optimizers that step them
    checkpoint/              sharded checkpoints that reshard, checked byte by byte, and the
                             whole state gathered onto every rank

Each module's docstring says what it is; docs/architecture.md draws the whole map.
"""
