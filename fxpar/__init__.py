"""fxpar: a distributed-training compiler for PyTorch transformers.

    program = fxpar.compile(model, "dp=2", example_inputs=(tokens, labels))
    runner = program.bind()                     # inside torchrun
    loss = runner.step(*runner.local_batch(tokens, labels))

Map: `plan` (what to do), `trace` (capture), `fxpar.passes` (graph rewrites), `fxpar.cost`
(formulas), `program` (the compiled job, pure data), `runtime` (one torchrun worker).
"""

from fxpar.errors import BindError, CaptureError, CollectiveError, FxparError, PlanError
from fxpar.mesh import Mesh
from fxpar.plan import Plan
from fxpar.program import Program, compile

__all__ = [
    "BindError",
    "CaptureError",
    "CollectiveError",
    "FxparError",
    "Mesh",
    "Plan",
    "PlanError",
    "Program",
    "compile",
]
__version__ = "0.1.0"
