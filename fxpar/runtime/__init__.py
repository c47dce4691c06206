"""The runtime: binds a compiled Program to one torchrun worker.

    environment.py       the torchrun variables and bind's timeout, checked, or an error with the fix
    process_groups.py    the default group and one group per mesh axis, all with a timeout
    communicator.py      every collective fxpar issues, counted and with errors that name the group
    collective_failures.py  what a failure says: the time really waited, timeout or gone peer
    live_runners.py      the lifecycle: one live runner per parameter, close ends them all
    gradient_buckets.py  data parallelism's hooks: bucketed all-reduce overlapping backward
    gradient_accumulation.py  steps without zero_grad sum their gradients, as one device's backwards
    random_seed.py       the job's one random seed, agreed at bind (rank 0's torch.manual_seed)
    batch_checks.py      a step's batch against what was compiled: BatchError before any collective
    batch_identity.py    the batch's fingerprint and sizes, compared by tp's and pp's step agreement
    step_loss.py         valid-target counts and each microbatch's share of the step's loss
    step_context.py      StepContext: everything of the bound rank an executor reads
    binding.py           bind's one-time work: device, state placed and made identical, StepContext
    module_executor.py   a step without a pipeline: each microbatch on the rank's one module
    pipeline_executor.py a step with a pipeline: the schedule's F, B and W actions
    weight_gradients.py  zero-bubble W actions: linear weight gradients deferred to a store
    full_state.py        full_state_dict / full_gradients: shards and stages gathered
    runner.py            Runner: step, optimizer, comm_stats, full_state_dict
"""
