"""Survey Hugging Face architectures under plans against one device (a tool, not a test).

    python tests/hf_survey.py --plans "tp=2" "tp=2 tp_rules=infer" "pp=2 mb=2" "dp=2 zero=3 mb=2"
    python tests/hf_survey.py --models phi3 gemma3 --world 4 --plans "dp=2 tp=2 zero=3"

Each job trains a model of `hf_models.BUILDERS` or `SURVEY` (all of them unless `--models`)
for 3 AdamW steps under one plan in its own torchrun launch (`workers/hf_worker.py`, so a
failing job fails alone), and holds it to one device exactly as the suite does
(`runtime/test_hf_equivalence.assert_equivalent`: the loss of every step, every gradient of
the first, all parameters after the last, relative 1e-5, the collectives against the
compiler's prediction, and the rank's memory against the estimate). It prints one line per
job, OK, DIFFERS (which check) or ERROR (fxpar's message: a PlanError is a refusal that says
why), and exits 1 if any job differs. How a new model family is checked before it joins
BUILDERS and the suite.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "runtime"))
from conftest import launch_torchrun  # noqa: E402
from hf_models import BUILDERS, SURVEY  # noqa: E402
from test_hf_equivalence import assert_equivalent, train_single_device  # noqa: E402

EAGER_ONLY = {"gemma2", "bloom", "mamba"}  # transformers gives them no sdpa attention


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=[*BUILDERS, *SURVEY], choices=[*BUILDERS, *SURVEY])
    parser.add_argument("--plans", nargs="+", default=["tp=2"])
    parser.add_argument("--world", type=int, default=2, help="ranks per launch")
    args = parser.parse_args()
    differs = 0
    for name in args.models:
        attention = "eager" if name in EAGER_ONLY else "sdpa"
        reference = train_single_device(name, attention)
        for plan in args.plans:
            job = f"{name} {attention} {plan}"
            with tempfile.TemporaryDirectory() as out:
                try:
                    ranks = launch_torchrun(Path(out), "hf_worker.py", args.world, job, timeout=600)
                except AssertionError as failure:
                    print(f"ERROR    {job}: {_last_error(str(failure))}", flush=True)
                    continue
            try:
                for results in ranks:
                    assert_equivalent(results[job], reference, job)
                print(f"OK       {job}", flush=True)
            except AssertionError as difference:
                differs += 1
                print(f"DIFFERS  {job}: {str(difference).splitlines()[0]}", flush=True)
    return 1 if differs else 0


def _last_error(output: str) -> str:
    """The exception line of the worker's traceback (not torchrun's about its child)."""
    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line) for line in output.splitlines()
             if "Error: " in line and "torch.distributed.elastic" not in line]
    return lines[-1][:400] if lines else output.strip().splitlines()[-1][:400]


if __name__ == "__main__":
    sys.exit(main())
