"""Tier 3: a runner's lifecycle (bind, close, bind again) and the errors a rank gets when its
peer is gone, from one torchrun launch of `workers/lifecycle_worker.py` (its doc lists the
scenarios). Every refusal is a clear error, none hangs, and what trains trains as one device.
"""

import pytest
import torch

pytestmark = pytest.mark.multirank


@pytest.fixture(scope="module")
def ranks(module_torchrun):
    return module_torchrun("lifecycle_worker.py", 2, timeout=240)


def error_of(results: dict, name: str) -> str:
    kind, message, _ = results[name]
    assert kind is not None, f"{name}: no error"
    return f"{kind}: {message}"


def test_a_live_runners_program_and_model_cannot_be_bound_again(ranks):
    for rank, results in enumerate(ranks):
        assert error_of(results, "bind the same program again").startswith(
            "BindError: program.bind() was already called on this program in this process, and "
            f"that runner (plan 'dp=2', rank {rank}) is still live"
        )
        message = error_of(results, "bind another program of the same model")
        assert message.startswith(
            "BindError: parameter 'wte.weight' of this program (plan 'dp=2 mb=2') is trained by "
            "a live runner of another program (plan 'dp=2')"
        )
        assert "Fix: runner.close() the other one first" in message and "copy.deepcopy(model)" in message


def test_runners_of_different_models_train_side_by_side_as_one_device(ranks):
    for results in ranks:
        assert results["bind a program of another model"][0] is None
        for name in ("first runner", "second runner", "rebound runner"):
            run = results[name]
            # fp32, a different summation order across 2 ranks: a few ulps
            assert run["loss"] == pytest.approx(run["expected_loss"], rel=1e-6), name
            assert run["grads"].keys() == run["expected_grads"].keys()
            for key, grad in run["grads"].items():
                torch.testing.assert_close(grad, run["expected_grads"][key], rtol=1e-5, atol=1e-7)


def test_close_ends_every_runner_and_a_closed_one_refuses_to_train(ranks):
    for rank, results in enumerate(ranks):
        for name, method in [("step after close", "step"), ("other runner's step after close", "step"),
                             ("optimizer after close", "optimizer"),
                             ("full_state_dict after close", "full_state_dict")]:
            assert error_of(results, name) == (
                f"BindError: runner.{method}() on a closed runner (plan 'dp=2', rank {rank}): "
                "runner.close() of the runner of plan 'dp=2' ended it and destroyed this "
                "process's groups, so it would train without synchronising anything. Fix: bind "
                "again (runner = program.bind()) and use the new runner"
            )
        assert results["close again"][0] is None
        assert results["comm_stats after close"]["all_reduce"]["count"] == 1  # still readable: the bucket
        assert results["bind after close"][0] is None


def test_a_gone_peer_is_named_with_the_time_really_waited(ranks):
    results = ranks[0]
    # The tiny model's one bucket: its 28,544 parameters, the loss, two count digits, two step slots.
    for name, call in [("full_state_dict, peer gone", "all_gather of full state: tp shards of "
                        "wte.weight (8,192 bytes) on the tp group [0, 1]"),
                       ("step, peer gone", "all_reduce of gradient bucket 0 + loss + valid targets + step "
                        f"({4 * (28_544 + 1 + 2 + 2):,} bytes) on the dp group [0, 1]")]:
        message = error_of(results, name)
        assert message.startswith(f"CollectiveError: {call} failed after 0.")
        assert "well before its 10 s timeout: rank 1 is gone" in message
        assert results[name][2] < 5  # fails at once, not at the timeout


def test_a_late_bind_with_a_gone_peer_is_a_bind_error_naming_the_group(ranks):
    results = ranks[0]
    late = error_of(results, "late bind, peer gone")
    assert late.startswith("BindError: program.bind() on rank 0 could not create the "
                           "tied-parameter group [0, 1]: creating it did not complete within 2 s")
    assert "DistStoreError" in late and results["late bind, peer gone"][2] < 2 + 5
    fresh = error_of(results, "bind after close, peer gone")
    assert fresh.startswith("BindError: program.bind() on rank 0 could not create the default "
                            "process group (every rank)")
    assert results["bind after close, peer gone"][2] < 2 + 5


EXITS_WITHOUT_CLOSE = """
import atexit, sys
import torch.distributed as dist
# Registered before fxpar's own: atexit runs it after fxpar's, and it says what was left.
atexit.register(lambda: print("groups left at exit:", dist.is_initialized(), flush=True))
sys.path.insert(0, sys.argv[1])
import torch, fxpar
from tiny_training import build_model, global_batches
tokens, labels = global_batches()[0]
runner = fxpar.compile(build_model(), "dp=1", (tokens, labels)).bind()
runner.step(*runner.local_batch(tokens, labels))
print("trained", flush=True)
"""


def test_a_script_that_ends_without_close_is_closed_at_exit(tmp_path):
    """`live_runners` rule 6: no process group is left alive into interpreter teardown, where
    gloo can abort the process ("terminate called without an active exception")."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "exits.py"
    script.write_text(EXITS_WITHOUT_CLOSE)
    workers = Path(__file__).parents[1] / "workers"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                           str(script), str(workers)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "trained" in done.stdout and "groups left at exit: False" in done.stdout, done.stdout
