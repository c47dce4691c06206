"""`plan="auto"`: the plans a world of devices could run, each priced, the fastest that fits chosen.

    space    the candidates: layouts, ZeRO, microbatches, schedules, sp, checkpointing
    budget   a device's memory, as written or as this machine has it
    search   filtering (plan rules, a memory bound, the estimate) and ranking; `PlanSearch`
    auto     one capture's search, each candidate priced by `program.estimate()`

`fxpar.plan_auto` and `fxpar.compile(model, "auto", ...)` are the entry points
(`fxpar.compiler.program`).
"""
