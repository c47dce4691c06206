"""fxpar: a distributed-training compiler for PyTorch transformers.

    program = fxpar.compile(model, "dp=2", example_inputs=(tokens, labels))
    runner = program.bind()                     # inside torchrun
    loss = runner.step(*runner.local_batch(tokens, labels))

    captured = fxpar.capture(hf_model, {"input_ids": ids, "labels": labels})  # one export,
    program = fxpar.compile(captured, "tp=2")                                  # many plans
    program.visualize("plan.svg"); program.report("plan.html")                 # see the plan
    print(fxpar.diff(program, fxpar.compile(captured, "dp=2")))                # compare two

Map: `plan` (what to do), `trace` (capture), `fxpar.passes` (graph rewrites), `fxpar.cost`
(formulas), `program` (the compiled job, pure data), `runtime` (one torchrun worker).
"""

import fxpar.distributed_ops  # noqa: F401  registers torch.ops.fxpar.*, which rank modules call
import fxpar.vocab_parallel_ops  # noqa: F401
from fxpar.errors import (
    BatchError, BatchMismatchError, BindError, CaptureError, CheckpointError, CollectiveError, FxparError, PlanError, StepMismatchError,
    VerifyError,
)
from fxpar.mesh import Mesh
from fxpar.plan import Plan
from fxpar.plan_diff import PlanDiff, diff
from fxpar.program import Program, compile
from fxpar.trace import CapturedGraph, capture
from fxpar.verify import verify
from fxpar.verify_report import VerifyReport

__all__ = [
    "BatchError",
    "BatchMismatchError",
    "BindError",
    "CapturedGraph",
    "CaptureError",
    "CheckpointError",
    "CollectiveError",
    "FxparError",
    "Mesh",
    "Plan",
    "PlanDiff",
    "PlanError",
    "Program",
    "StepMismatchError",
    "VerifyError",
    "VerifyReport",
    "capture",
    "compile",
    "diff",
    "verify",
]
__version__ = "0.1.0"
