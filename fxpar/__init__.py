"""fxpar: a distributed-training compiler for PyTorch transformers.

    program = fxpar.compile(model, "dp=2", example_inputs=(tokens, labels))
    runner = program.bind()                     # inside torchrun
    loss = runner.step(*runner.local_batch(tokens, labels))

    captured = fxpar.capture(hf_model, {"input_ids": ids, "labels": labels})  # one export,
    program = fxpar.compile(captured, "tp=2")                                  # many plans
    program.visualize("plan.svg"); program.report("plan.html")                 # see the plan
    print(fxpar.diff(program, fxpar.compile(captured, "dp=2")))                # compare two

Map (docs/architecture.md): `plan` (what to do), `frontend` (capture), `ir` (the data every
layer reads), `ops` (the operators rank modules call), `passes` (graph rewrites), `cost`
(formulas), `compiler` (the compiled job, pure data), `runtime` (one torchrun worker),
`pictures` and `tools` (what people read and run).
"""

from fxpar.compiler.program import Program, compile, plan_auto
from fxpar.errors import (
    BatchError, BatchMismatchError, BindError, CaptureError, CheckpointError, CollectiveError, FxparError, PlanError, StepMismatchError,
    VerifyError,
)
from fxpar.frontend.trace import CapturedGraph, capture
from fxpar.ir.mesh import Mesh
import fxpar.ops.distributed  # noqa: F401  registers torch.ops.fxpar.*, which rank modules call
import fxpar.ops.vocab_parallel  # noqa: F401
import fxpar.ops.expert_routing  # noqa: F401
import fxpar.ops.token_dispatch  # noqa: F401
from fxpar.plan.plan import Plan
from fxpar.planner.search import PlanSearch
from fxpar.tools.diff import PlanDiff, diff
from fxpar.tools.verify import verify
from fxpar.tools.verify_report import VerifyReport

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
    "PlanSearch",
    "Program",
    "StepMismatchError",
    "VerifyError",
    "VerifyReport",
    "capture",
    "compile",
    "diff",
    "plan_auto",
    "verify",
]
__version__ = "0.1.0"
