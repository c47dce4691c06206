"""The runtime: binds a compiled Program to one torchrun worker.

    environment.py       the torchrun variables, or an error that shows the command to use
    process_groups.py    the default group and one group per mesh axis, all with a timeout
    communicator.py      every collective fxpar issues, counted and with errors that name the group
    gradient_buckets.py  data parallelism's hooks: bucketed all-reduce overlapping backward
    runner.py            Runner: step, optimizer, comm_stats, full_state_dict
"""
