"""The `fxpar` command line (also `python -m fxpar`): see a plan without writing a script.

    fxpar explain  --model examples/gpt.py:factory --plan "tp=2 pp=2 mb=4"
    fxpar viz      --model examples/gpt.py:factory --plan "tp=2 pp=2 mb=4" -o plan.svg
    fxpar report   --model examples/gpt.py:factory --plan plan.yaml -o plan.html
    fxpar check    --hf llama --config num_hidden_layers=2 hidden_size=64 --plan "dp=2 tp=2"
    fxpar estimate --model examples/gpt.py:factory --plan dp=8 --hardware h100
    fxpar diff "dp=4" "dp=2 tp=2" --model examples/gpt.py:factory
    fxpar plan     --model examples/gpt.py:factory --config n_layer=2 --world 4 --hardware h100 --memory 80GB
    fxpar verify   --model examples/gpt.py:factory --config n_layer=2 seq=16 batch=8 --plan "dp=2 tp=2"

The model is `--model FILE.py:FACTORY` or `package.module:FACTORY` (a function returning the
model and one example batch; `--config key=value` are its keyword arguments) or `--hf FAMILY`
(a transformers model built from its config, `--config` setting the config's fields; nothing
is downloaded). `--plan` takes the plan's text or a .json/.yaml file (`fxpar.Plan.parse`).

Exit status: 0 when the command did what it says, 1 when `check` finds a plan that cannot
run or `verify` a node that differs from one device (or a run that failed), 2 for a usage error (a bad flag, a model that cannot be loaded or captured, an invalid
plan), with the message on stderr and no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from fxpar.errors import CaptureError, PlanError
from fxpar.tools.model_loading import ModelSpecError, build_from_factory, build_hugging_face, parse_config

T = TypeVar("T")
EXAMPLE = "--model examples/gpt.py:factory"
COMMANDS = {
    "explain": ("stages, buckets, collectives per step and the estimate of one rank",
                f'fxpar explain {EXAMPLE} --plan "tp=2 pp=2 mb=4"'),
    "viz": ("draw the partitioned graph with graphviz (.svg, .png or .pdf)",
            f'fxpar viz {EXAMPLE} --plan "tp=2 pp=2 mb=4" -o plan.svg --expand h.1'),
    "report": ("write the one-page HTML report",
               f'fxpar report {EXAMPLE} --plan "dp=2 tp=2 pp=2 mb=4" -o plan.html'),
    "check": ("prove every rank's collectives match and the schedule cannot deadlock",
              'fxpar check --hf llama --config num_hidden_layers=2 hidden_size=64 '
              'intermediate_size=128 num_attention_heads=4 num_key_value_heads=2 vocab_size=256 '
              '--plan "dp=2 tp=2"'),
    "estimate": ("predict FLOPs, memory, bytes moved and time of one step",
                 f"fxpar estimate {EXAMPLE} --plan dp=8 --hardware h100"),
    "diff": ("what changes between two plans of one model",
             f'fxpar diff "dp=4" "dp=2 tp=2" {EXAMPLE}'),
    "plan": ("choose a plan for N devices: the fastest that fits, the ten fastest, why the rest do not",
             f"fxpar plan {EXAMPLE} --config n_layer=2 --world 4 --hardware h100 --memory 80GB"),
    "verify": ("run one step of the plan on CPU ranks and one device; name the first node that differs",
               f'fxpar verify {EXAMPLE} --config n_layer=2 seq=16 batch=8 --plan "dp=2 tp=2"'),
}


class UsageError(ValueError):
    """A command given what it cannot use; exit status 2."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (see module doc)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        try:
            return RUN[args.command](args)
        except (UsageError, ModelSpecError, PlanError, CaptureError) as error:
            print(f"fxpar {args.command}: error: {error}", file=sys.stderr)
            return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fxpar", description="See what a distributed-training plan does to a model, from a shell.",
        epilog="examples:\n" + "\n".join(f"  {example}" for _, example in COMMANDS.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (summary, example) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=f"{summary}.", epilog=f"example:\n  {example}",
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == "diff":
            sub.add_argument("plans", nargs=2, metavar=("PLAN_A", "PLAN_B"), help="two plans: text or .json/.yaml files")
        _model_options(sub, plan=name not in ("diff", "plan"))
        if name in ("explain", "viz", "report", "diff"):
            sub.add_argument("--rank", type=int, default=None,
                             help="the rank to show (viz: default the global view; others: 0)")
        if name in ("explain", "report", "estimate", "diff", "plan"):
            sub.add_argument("--hardware", default="h100", help="cost profile: cpu, a100, h100, h200 (default h100)")
        if name in ("viz", "report"):
            sub.add_argument("-o", "--output", type=Path, default=Path(f"plan.{'svg' if name == 'viz' else 'html'}"),
                             help=f"the file to write (default plan.{'svg' if name == 'viz' else 'html'})")
        if name == "viz":
            sub.add_argument("--detail", choices=("module", "node"), default="module",
                             help="one box per module (default) or per aten node")
            sub.add_argument("--expand", nargs="+", default=[], metavar="MODULE", help="modules to open, e.g. h.3")
        if name == "report":
            sub.add_argument("--compare", metavar="PLAN", help="another plan of the model to diff against")
        if name == "plan":
            sub.add_argument("--world", type=int, required=True, help="the number of devices")
            sub.add_argument("--memory", help="memory per device: 80GB, 24GiB, bytes (default this machine's)")
            sub.add_argument("--devices-per-node", type=int, help="bounds tp (default the profile's)")
            sub.add_argument("--fix", default=None, metavar="FIELDS",
                             help='plan fields every candidate keeps, e.g. "precision=bf16-mixed"')
            sub.add_argument("--top", type=int, default=10, help="how many of the fastest to list (default 10)")
        if name in ("estimate", "plan"):
            sub.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd", "sgd-momentum"))
        if name == "verify":
            from fxpar.tools.verify_report import ATOL, RTOL

            sub.add_argument("--rtol", type=float, default=RTOL, help=f"relative tolerance (default {RTOL:g})")
            sub.add_argument("--atol", type=float, default=ATOL, help=f"absolute floor (default {ATOL:g})")
            sub.add_argument("--timeout", type=float, default=30.0, help="seconds a collective may wait (default 30)")
            sub.add_argument("--no-check", action="store_true", help="run even a program check() refuses")
    return parser


def _model_options(sub: argparse.ArgumentParser, *, plan: bool) -> None:
    model = sub.add_argument_group("the model (one of --model and --hf)")
    model.add_argument("--model", metavar="FILE.py:FACTORY", help="a factory returning (model, example_inputs)")
    model.add_argument("--hf", metavar="FAMILY", help="a transformers model type built from its config: llama, gpt2, ...")
    model.add_argument("--config", nargs="+", default=[], metavar="KEY=VALUE",
                       help="the factory's keyword arguments, or the Hugging Face config's fields")
    model.add_argument("--batch", type=int, default=8, help="--hf: the example batch's sequences (default 8)")
    model.add_argument("--seq", type=int, default=128, help="--hf: the example batch's length (default 128)")
    if plan:
        sub.add_argument("--plan", required=True, help='the plan: text such as "dp=2 tp=2" or a .json/.yaml file')


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _capture(args):
    import fxpar.frontend.trace

    if (args.model is None) == (args.hf is None):
        raise UsageError("give the model with exactly one of --model FILE.py:FACTORY and --hf FAMILY "
                         f"(e.g. {EXAMPLE})")
    config = parse_config(args.config)
    if args.model is not None:
        model, inputs = build_from_factory(args.model, config)
    else:
        model, inputs = build_hugging_face(args.hf, config, batch=args.batch, seq=args.seq)
    return fxpar.frontend.trace.capture(model, inputs)


def _compile(captured, plan: str):
    from fxpar.compiler.program import compile
    from fxpar.plan.plan import Plan

    return compile(captured, Plan.parse(plan))


def _program(args):
    return _compile(_capture(args), args.plan)


def _rank(args, program) -> int:
    rank = 0 if args.rank is None else args.rank
    if not 0 <= rank < program.world_size:
        raise UsageError(f"--rank {rank}: the plan has ranks 0..{program.world_size - 1}")
    return rank


def run_explain(args) -> int:
    from fxpar.tools.explain import explain

    program = _program(args)
    print(explain(program, rank=_rank(args, program), hardware=_hardware(args.hardware)))
    return 0


def run_viz(args) -> int:
    from fxpar.pictures.visualize import FORMATS, visualize

    _check_output(args.output, suffixes=tuple(FORMATS))
    program = _program(args)
    rank = None if args.rank is None else _rank(args, program)
    path = _options_checked(lambda: visualize(program, args.output, rank=rank, detail=args.detail,
                                              expand=args.expand))
    print(f"wrote {path}")
    return 0


def run_report(args) -> int:
    from fxpar.tools.report import write_report

    _check_output(args.output, suffixes=(".html", ".htm"))
    captured = _capture(args)
    program = _compile(captured, args.plan)
    compare = _compile(captured, args.compare) if args.compare else None
    rank, hardware = _rank(args, program), _hardware(args.hardware)
    path = _options_checked(lambda: write_report(program, args.output, rank=rank, hardware=hardware, compare=compare))
    print(f"wrote {path}")
    return 0


def run_check(args) -> int:
    program = _program(args)
    try:
        program.check()
    except PlanError as error:
        print(f"fxpar check: FAILED: {error}", file=sys.stderr)
        return 1
    pipeline = ", every send has its receive and the schedule cannot deadlock" if program.stages else ""
    print(f"check passed: plan '{program.plan}', {program.world_size} ranks: on every process group all "
          f"ranks issue the same collectives{pipeline}")
    return 0


def run_estimate(args) -> int:
    print(_program(args).estimate(_hardware(args.hardware), optimizer=args.optimizer).table())
    return 0


def run_diff(args) -> int:
    from fxpar.tools.diff import diff

    captured = _capture(args)
    before, after = (_compile(captured, plan) for plan in args.plans)
    rank, hardware = 0 if args.rank is None else args.rank, _hardware(args.hardware)
    print(_options_checked(lambda: diff(before, after, rank=rank, hardware=hardware)))
    return 0


def _check_output(path: Path, *, suffixes: tuple[str, ...]) -> None:
    """UsageError unless `path` can be written: a file name with one of `suffixes` (which pick
    the format), in a folder that exists and is writable. Checked before the model is built and
    captured, so a typo in -o costs no compile."""
    folder, example = path.parent, f"plan{suffixes[0]}"
    if path.is_dir():
        problem, fix = "is a folder", f"name a file in it, e.g. -o {path / example}"
    elif path.suffix.lower() not in suffixes:
        ending = f"ends in {path.suffix!r}" if path.suffix else "has no suffix"
        problem, fix = (f"{ending}, and the suffix picks the format",
                        f"end it in one of {', '.join(suffixes)}, e.g. -o {path.with_suffix(suffixes[0])}")
    elif not folder.exists():
        problem, fix = f"names folder {str(folder)!r}, which does not exist", f"create it (mkdir -p {folder}) or write elsewhere"
    elif not folder.is_dir():
        problem, fix = f"names folder {str(folder)!r}, which is a file", f"name a file in a folder, e.g. -o {example}"
    elif not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        problem, fix = "cannot be written (permission denied)", f"write to a folder of yours, e.g. -o ./{example}"
    else:
        return
    raise UsageError(f"-o {str(path)!r} {problem}. Fix: {fix}")


def run_plan(args) -> int:
    from fxpar.compiler.program import plan_auto

    if args.world < 1:
        raise UsageError(f"--world {args.world}: the number of devices is a positive integer")
    search = plan_auto(_capture(args), world_size=args.world, hardware=_hardware(args.hardware),
                       memory_per_device=args.memory, devices_per_node=args.devices_per_node,
                       fixed=args.fix, optimizer=args.optimizer)
    print(search.table(top=args.top))
    return 0


def _options_checked(call: Callable[[], T]) -> T:
    """`call()`, where a ValueError can only be about the options it was given (a suffix, a
    module to expand, a rank, two models): a usage error."""
    try:
        return call()
    except ValueError as error:
        raise UsageError(str(error)) from None


def _hardware(name: str) -> str:
    from fxpar.cost.profile_files import is_profile_file, load_profile
    from fxpar.cost.profiles import KNOWN

    if is_profile_file(name):
        _options_checked(lambda: load_profile(name))  # read now: a bad file is a usage error
    elif name not in KNOWN:
        raise UsageError(f"--hardware {name!r}: known profiles are {', '.join(KNOWN)}, or a profile "
                         "file FILE.json (`python -m fxpar.cost.calibrate -o FILE.json`)")
    return name


def run_verify(args) -> int:
    from fxpar.errors import VerifyError
    from fxpar.tools.verify import verify

    if args.hf is not None:
        raise UsageError("verify runs the model, and --hf builds it on the meta device without weights. "
                         "Fix: give --model FILE.py:FACTORY returning a model with real (random) weights")
    if args.model is None:
        raise UsageError(f"give the model with --model FILE.py:FACTORY (e.g. {EXAMPLE})")
    import fxpar.frontend.trace

    model, inputs = build_from_factory(args.model, parse_config(args.config))
    program = _compile(fxpar.frontend.trace.capture(model, inputs), args.plan)
    try:
        report = verify(program, example_inputs=inputs, rtol=args.rtol, atol=args.atol,
                        timeout=args.timeout, check=not args.no_check)
    except VerifyError as error:
        print(f"fxpar verify: FAILED: {error}", file=sys.stderr)
        return 1
    print(report)
    return 0 if report.equal else 1


RUN = {"explain": run_explain, "viz": run_viz, "report": run_report, "check": run_check,
       "estimate": run_estimate, "diff": run_diff, "plan": run_plan, "verify": run_verify}
