"""torchrun worker: a runner's lifecycle, and what a rank sees when its peer goes away.

    torchrun --standalone --nproc-per-node 2 lifecycle_worker.py OUT_DIR

Both ranks, in order (one launch for every scenario: a world takes seconds to come up):

1. bind a program, then bind it again, and bind another program of the same model: refused;
2. bind a program of another model while the first is live: both train, each exactly as one
   device would (no hook of one fires in the other);
3. close one runner: both are closed, and stepping, building an optimizer or gathering the
   state is refused; closing again is harmless;
4. bind the first program again: it trains as one device would.

Then rank 1 saves and exits, and rank 0 records what fails, and how fast: gathering a
tensor-parallel state, a data-parallel step, a late bind that must create a group, and a bind
after close that must create the default group. Each outcome is (error type, message, seconds).
"""

import os
import sys
import time
from pathlib import Path

import torch

import fxpar
from tiny_training import OPTIMIZER, build_model, global_batches

out_dir = Path(sys.argv[1])
torch.set_num_threads(1)
tokens, labels = global_batches()[0]
results: dict[str, object] = {}


def outcome(name: str, action) -> object:
    start = time.perf_counter()
    try:
        value = action()
        results[name] = (None, None, time.perf_counter() - start)
        return value
    except Exception as error:  # noqa: BLE001  (the test reads the type and message)
        results[name] = (type(error).__name__, str(error), time.perf_counter() - start)
        return None


def one_device(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model(tokens, labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return loss.item(), grads


def trained(runner, reference: torch.nn.Module) -> dict[str, object]:
    """One step's loss and gradients next to one device's (same initial weights)."""
    loss = runner.step(*runner.local_batch(tokens, labels))
    grads = runner.full_gradients()
    for module in runner.modules:
        module.zero_grad(set_to_none=True)
    expected_loss, expected_grads = one_device(reference)
    return {"loss": loss, "expected_loss": expected_loss,
            "grads": grads, "expected_grads": {n: expected_grads[n] for n in grads}}


# 1. a program bound once at a time
model = build_model()
program = fxpar.compile(model, "dp=2", example_inputs=(tokens, labels))
runner = program.bind(timeout=10)
outcome("bind the same program again", lambda: program.bind(timeout=10))
same_model = fxpar.compile(model, "dp=2 mb=2", example_inputs=(tokens, labels))
outcome("bind another program of the same model", lambda: same_model.bind(timeout=10))

# 2. programs of different models live together
other = fxpar.compile(build_model(seed=1), "dp=2", example_inputs=(tokens, labels))
other_runner = outcome("bind a program of another model", lambda: other.bind(timeout=10))
results["first runner"] = trained(runner, build_model())
results["second runner"] = trained(other_runner, build_model(seed=1))

# 3. close ends both; a closed runner refuses to train
runner.close()
outcome("step after close", lambda: runner.step(*runner.local_batch(tokens, labels)))
outcome("other runner's step after close", lambda: other_runner.step(*other_runner.local_batch(tokens, labels)))
outcome("optimizer after close", lambda: runner.optimizer(torch.optim.AdamW, **OPTIMIZER))
outcome("full_state_dict after close", runner.full_state_dict)
outcome("close again", runner.close)
results["comm_stats after close"] = runner.comm_stats()

# 4. bind again after close
again = outcome("bind after close", lambda: program.bind(timeout=10))
results["rebound runner"] = trained(again, build_model())

# 5. the peer goes away
tensor_parallel = fxpar.compile(build_model(seed=2), "tp=2", example_inputs=(tokens, labels)).bind(timeout=10)
tensor_parallel.step(*tensor_parallel.local_batch(tokens, labels))
if tensor_parallel.rank == 1:
    torch.save(results, out_dir / "rank1.pt")
    os._exit(0)  # gone, with exit code 0 so that torchrun lets rank 0 carry on
time.sleep(0.5)
outcome("full_state_dict, peer gone", tensor_parallel.full_state_dict)
outcome("step, peer gone", lambda: again.step(*again.local_batch(tokens, labels)))
late = fxpar.compile(build_model(seed=3), "pp=2 mb=2", example_inputs=(tokens, labels))
outcome("late bind, peer gone", lambda: late.bind(timeout=2))  # its tied-weight group waits
again.close()
outcome("bind after close, peer gone", lambda: late.bind(timeout=2))
torch.save(results, out_dir / "rank0.pt")
os._exit(0)  # the groups are broken: destroying them could wait on the silent peer
