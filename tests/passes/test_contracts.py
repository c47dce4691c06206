"""run_passes holds every pass to its written contract (passes.contracts) when checking is on,
as it is in the whole test suite."""

import functools
import sys
from pathlib import Path

import pytest

import fxpar
from fxpar.ir import meta
from fxpar.passes.contracts import ContractError, checking
from fxpar.passes.data_parallel import assign_gradient_buckets
from fxpar.passes.infra import run_passes
from fxpar.passes.tensor_parallel.rewrite import every_tensor_placed

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
from tiny_training import build_model, global_batches  # noqa: E402

TOKENS, LABELS = global_batches()[0]


def test_the_suite_checks_contracts():
    assert checking()


def test_a_pass_that_breaks_its_promise_is_named_with_the_node(monkeypatch):
    program = fxpar.compile(build_model("gpt"), "tp=2", (TOKENS, LABELS))

    def forgets_a_placement(gm):
        node = next(n for n in gm.graph.nodes if n.op == "call_function" and meta.PLACEMENT in n.meta)
        del node.meta[meta.PLACEMENT]
        return gm

    forgets_a_placement.ensures = (every_tensor_placed,)
    with pytest.raises(ContractError, match=r"every tensor node has a placement.*module") as error:
        run_passes(program.graph_module, [forgets_a_placement])
    assert "pass forgets_a_placement failed" in "".join(error.value.__notes__)
    monkeypatch.setenv("FXPAR_CHECK_PASSES", "0")
    run_passes(program.graph_module, [forgets_a_placement])  # unchecked, nothing is said


def test_partial_passes_are_checked_too():
    program = fxpar.compile(build_model("gpt"), "dp=2", (TOKENS, LABELS))

    def loses_a_bucket(gm):
        gm = assign_gradient_buckets(gm, bucket_bytes=1)
        gm.meta[meta.GRAPH_BUCKETS] = meta.graph_buckets(gm)[1:]
        return gm

    checked = functools.partial(loses_a_bucket)
    checked.func.ensures = assign_gradient_buckets.ensures
    with pytest.raises(ContractError, match="is in a bucket"):
        run_passes(program.captured.graph_module, [checked])
