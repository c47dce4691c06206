"""How far `program.estimate()` is from what a real step does: each term, predicted and measured.

    python benchmarks/bench_cost_model.py                      # ~1 minute on 2 CPU cores
    python benchmarks/bench_cost_model.py --models tiny --steps 10 --json out.json

For each GPT size (`harness.GPT_SIZES`) the script runs three configurations, each in its own
torchrun job, one compute thread per rank (2 ranks on a 2-core machine):

    dp=1, global batch B        plain single-process training
    dp=1, global batch B/2      the baseline of the one below: the same per-rank work
    dp=2, global batch B        two ranks, gloo all-reduce of gradient buckets

and prints one table per configuration, `term | predicted | measured | error %` with
error = (predicted - measured) / measured (positive: the model over-predicts):

* params, grads, optimizer: bytes of the distinct parameters, their `.grad` and the AdamW
  state tensors (Adam's 4-byte `step` counters included) right after `optimizer.step()`;
  expected exact;
* activations (saved): bytes of the distinct storages autograd packs in the real forward
  (`saved_tensors_hooks`), parameters left out; expected exact, as the model asks autograd
  the same question under fake tensors;
* peak fwd+bwd: bytes held before the step (model state, gradient buckets, the input batch)
  plus the peak of the forward and backward's own allocations (`torch.profiler`,
  `profile_memory=True`), against `memory.total`, the predicted peak. The JSON also has
  `peak_step`, the same over the whole step with the optimizer's; workspace: that peak minus
  the bytes held before the step and the saved activations, against `memory.workspace`
  (meaningful where the peak is at the start of backward, as in every run so far);
* compute, optimizer, step: medians of `--steps` timed steps after `--warmup` (max over
  ranks) of `runner.step` (forward + backward, and under dp=2 the gradient all-reduces it
  waits for), of `opt.step(); opt.zero_grad()`, and of the whole step, against
  `time.compute`, `time.optimizer`, `time.total`; the `cpu time` rows are the same phases in
  main-thread CPU time (`time.thread_time`, mean over ranks), which leaves out time spent
  waiting for a core another process holds: the quieter measure on a shared machine;
* comm exposed (dp=2): the dp=2 step minus the dp=1 step of the same per-rank batch, against
  `time.comm_exposed`; comm alone: the same all-reduces timed without compute, against the
  alpha-beta sum over the calls (what the model predicts before overlap);
* per-op sum (proposal): not the estimate, a candidate replacement for `time.compute`:
  every aten call of the graph run alone, forward and backward, at its real shapes, on this
  device (`cost_model_harness.per_op_seconds`), against the measured forward + backward
  (its CPU time on the CPU, where the dp=2 wall time also holds all-reduce waits);
* all_reduce calls and payload: `runner.comm_stats()` over one step against `est.comm`;
  must be exactly equal.

The `cpu` hardware profile is measured once at the start, at one thread, into a fresh
`FXPAR_CACHE_DIR` (or `--profile-cache DIR` to reuse one), so its constants describe the
machine as it is during the run. It is cached even when the machine is loaded (which
`measure_cpu` would refuse), because every job must use the same profile; the load average
at calibration is printed with it. The script ends with the mean absolute error per term.

On a CUDA machine the runner trains on the GPU (`bind()`'s default device), the estimate
uses the GPU's datasheet profile (`--hardware`, default by device name), times are taken
after `torch.cuda.synchronize`, and the peak is `torch.cuda.max_memory_allocated` (all
tensors on the device, so no "held before" term). Two ranks on one GPU need
`--backend gloo`. This path has not been run yet: the tables in RESULTS.md are CPU ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

from cost_model_harness import (  # noqa: E402
    allocation_peak, cuda_peak, isolated_collectives, model_state_bytes, per_op_seconds,
    saved_activations, timed_steps,
)
from harness import (  # noqa: E402
    GLOBAL_BATCH, GPT_SIZES, OPTIMIZER, SEQ, distinct_storage_bytes, format_table,
)

MODELS = GPT_SIZES


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch", type=int, default=GLOBAL_BATCH, help="global batch (even)")
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--steps", type=int, default=20, help="timed steps (>= 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--profile-cache", type=Path, default=None,
                        help="FXPAR_CACHE_DIR to reuse (default: a fresh one, measured now)")
    parser.add_argument("--hardware", default=None,
                        help="profile the estimate uses (default: cpu, or on CUDA the GPU's: "
                             "h200, a100 or h100)")
    parser.add_argument("--backend", default=None,
                        help="bind() backend (default: nccl on CUDA, gloo on the CPU; use gloo "
                             "for 2 ranks sharing one GPU)")
    parser.add_argument("--json", type=Path, default=None, help="write all results here")
    parser.add_argument("--seed", type=int, default=0)
    # worker mode (set by the driver, inside torchrun)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dp", type=int, default=1, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# -- worker: one torchrun job, one plan and global batch, every model size ----------------


def build(name: str, args: argparse.Namespace, batch: int):
    from gpt import GPT

    config = dataclasses.replace(MODELS[name], block_size=args.seq)
    torch.manual_seed(args.seed)
    model = GPT(config)
    generator = torch.Generator().manual_seed(args.seed + 1)
    x, y = (torch.randint(0, config.vocab_size, (batch, args.seq), generator=generator)
            for _ in range(2))
    return model, x, y


def autograd_nodes(loss: torch.Tensor) -> int:
    """Nodes of the backward graph behind `loss` (AccumulateGrad leaves included)."""
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return len(seen)


def measure(name: str, args: argparse.Namespace, batch: int):
    import fxpar
    from fxpar.cost.collectives import collective_time
    from fxpar.cost.profiles import hardware_profile
    from fxpar.cost.ops import cost_of

    model, x, y = build(name, args, batch)
    program = fxpar.compile(model, f"dp={args.dp}", example_inputs=(x, y))
    # The threads were set to 1 before: on the CPU this is the 1-thread profile.
    est = program.estimate(args.hardware)
    profile = hardware_profile(args.hardware)
    if args.hardware == "cpu":
        assert profile.measured["threads"] == torch.get_num_threads() == 1, profile.measured
    runner = program.bind(timeout=120, backend=args.backend)
    device = runner.device
    cuda = device.type == "cuda"
    opt = runner.optimizer(torch.optim.AdamW, **OPTIMIZER)
    # Clones: a `tensor_split` slice is a view whose storage is the whole global batch.
    local = [t.to(device).clone() for t in runner.local_batch(x, y)]
    params = list(runner.module.parameters())

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def forward_backward():
        return runner.step(*local)  # returns a float: the device is synchronised

    def optimizer_step():
        opt.step()
        opt.zero_grad()
        sync()

    for _ in range(2):
        forward_backward()
        optimizer_step()

    # Communication and model state over one step.
    runner.reset_comm_stats()
    forward_backward()
    comm = runner.comm_stats()
    payloads = [(call.numel, call.dtype) for call in runner.comm_log()]
    opt.step()
    state = model_state_bytes(runner.module, opt)
    opt.zero_grad()

    # Saved activations of a real forward (the backward runs too, packing nothing).
    saved = saved_activations(forward_backward, exclude=params)
    optimizer_step()

    # Peak memory: bytes held before the step plus the peak of the step's own allocations.
    buckets = runner._context.buckets  # the flat gradient buffers under dp > 1 (one per module)
    bucket_buffers = [s.buffer for group in buckets for s in group.states if s.buffer is not None]
    optimizer_state = [v for s in opt.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor)]
    held = distinct_storage_bytes([*params, *optimizer_state, *bucket_buffers, *local])
    if cuda:
        peak_fb = cuda_peak(forward_backward, device)
        optimizer_step()
        peak_step = cuda_peak(lambda: (forward_backward(), optimizer_step()), device)
    else:
        peak_fb = held + allocation_peak(forward_backward)["peak"]
        optimizer_step()
        peak_step = held + allocation_peak(lambda: (forward_backward(), optimizer_step()))["peak"]

    times, cpu_times = timed_steps(
        [forward_backward, lambda: (opt.step(), sync()), lambda: (opt.zero_grad(), sync())],
        warmup=args.warmup, steps=args.steps, world_size=args.dp,
    )

    def medians(per_step: list[list[float]]) -> dict[str, float]:
        return {
            "compute": statistics.median(t[0] for t in per_step),
            "optimizer": statistics.median(t[1] + t[2] for t in per_step),
            "total": statistics.median(sum(t) for t in per_step),
        }

    measured_time, measured_cpu = medians(times), medians(cpu_times)
    comm_alone = predicted_alone = None
    if args.dp > 1:
        comm_alone = isolated_collectives(payloads, warmup=args.warmup, steps=args.steps,
                                          device=device)
        link = profile.link(tuple(range(args.dp)))
        predicted_alone = float(sum(
            collective_time(c.kind, c.payload_bytes, len(c.group), link)
            for c in program.collectives(runner.rank)
        ))

    # The rank module's forward takes, after the batch, the step's count of valid targets
    # where the loss is a sum over it (`program.input_names`, passes.loss_normalisation): here
    # the global batch's, as the runtime passes it.
    forward_inputs = list(local)
    if len(program.input_names) > len(local):
        forward_inputs.append(program.loss_reduction.count_module(x, y).to(device))

    # The proposal's compute model, for comparison: every op of the graph timed alone.
    op_sum = per_op_seconds(runner.module, forward_inputs, sync=sync)

    # Op counts, for a per-op overhead model of time: forward ops that cost anything, and
    # the nodes of the backward graph.
    forward_ops = sum(
        1 for node in runner.module.graph.nodes
        if (cost := cost_of(node, program.captured.shape)) is not None
        and (cost.bytes != 0 or cost.matmul_flops != 0 or cost.other_flops != 0)
    )
    backward_nodes = autograd_nodes(runner.module(*forward_inputs))
    result = {
        "model": name,
        "config": {k: getattr(MODELS[name], k) for k in ("n_layer", "n_embd", "n_head")},
        "plan": f"dp={args.dp}",
        "global_batch": batch,
        "local_batch": batch // args.dp,
        "seq": args.seq,
        "parameters": program.captured.parameter_count(),
        "estimate": {"memory": est.memory, "time": est.time, "comm": est.comm,
                     "flops": est.flops, "hardware": est.hardware},
        "measured": {
            "state": state,
            "activations": saved,
            "held_before_step": held,
            "peak_forward_backward": peak_fb,
            "peak_step": peak_step,
            "time": measured_time,
            "cpu_time": measured_cpu,
            "times": times,
            "cpu_times": cpu_times,
            "comm": comm,
            "comm_alone": comm_alone,
        },
        "predicted_comm_alone": predicted_alone,
        "per_op_compute": op_sum,
        "forward_ops": forward_ops,
        "backward_nodes": backward_nodes,
        "optimizer_tensors": len(params),
    }
    runner.reset_comm_stats()
    return result, runner


def worker(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # before program.estimate("cpu"): the profile is per thread count
    results, runner = [], None
    for name in args.models:
        result, runner = measure(name, args, args.batch)
        results.append(result)
        if runner.is_main:
            print(f"  {name} dp={args.dp} batch={args.batch}: step "
                  f"{1e3 * result['measured']['time']['total']:.1f} ms measured, "
                  f"{1e3 * result['estimate']['time']['total']:.1f} ms predicted", flush=True)
    is_main = runner.is_main
    runner.close()  # the runners of every model share one process group
    if is_main:
        args.worker.write_text(json.dumps(results))
    return 0


# -- driver: calibrate, launch the jobs, print the tables ---------------------------------


def calibrate(cache: Path) -> dict:
    """The 1-thread cpu profile in `cache`: read if there, else measured and written, loaded
    or not (the jobs must share one profile; the report shows the load it was taken under)."""
    os.environ["FXPAR_CACHE_DIR"] = str(cache)
    torch.set_num_threads(1)
    from fxpar.cost import calibrate as calibration

    readings = calibration.measure_cpu().measured
    if not calibration.cache_file(1).is_file():
        print(f"note: calibrated under load (1-minute load average {readings['load_average']:.1f}"
              f" on {readings['cores']} cores); caching it anyway for this run's jobs", flush=True)
        calibration.write_cache(readings)
    return dict(readings)


def launch(args: argparse.Namespace, dp: int, batch: int, out: Path) -> list[dict]:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={dp}",
        str(Path(__file__).resolve()), "--worker", str(out), "--dp", str(dp),
        "--batch", str(batch), "--seq", str(args.seq), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--seed", str(args.seed), "--models", *args.models,
        "--hardware", args.hardware, *(["--backend", args.backend] if args.backend else []),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(command, check=True, env=env)
    return json.loads(out.read_text())


def error(predicted: float, measured: float) -> float | None:
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return 100 * (predicted - measured) / measured


def fmt_bytes(value: float) -> str:
    if abs(value) >= 2**20:
        return f"{value / 2**20:.3f} MiB"
    if abs(value) >= 2**10:
        return f"{value / 2**10:.2f} KiB"
    return f"{value:.0f} B"


def fmt_ms(value: float) -> str:
    return f"{1e3 * value:.2f} ms"


def rows_of(r: dict, baseline: dict | None) -> list[tuple[str, str, str, float | None]]:
    """(term, predicted, measured, error %) for one configuration."""
    est, got = r["estimate"], r["measured"]
    mem, state = est["memory"], got["state"]
    rows = [
        ("params", mem["params"], state["params"], fmt_bytes),
        ("grads", mem["grads"], state["grads"], fmt_bytes),
        ("optimizer", mem["optimizer"], state["optimizer"], fmt_bytes),
        ("activations (saved)", mem["activations"], got["activations"]["bytes"], fmt_bytes),
        ("workspace (peak - held - saved)", mem["workspace"],
         got["peak_forward_backward"] - got["held_before_step"] - got["activations"]["bytes"],
         fmt_bytes),
        ("peak fwd+bwd vs total (peak)", mem["total"], got["peak_forward_backward"], fmt_bytes),
        ("time compute (fwd+bwd)", est["time"]["compute"], got["time"]["compute"], fmt_ms),
        ("time optimizer", est["time"]["optimizer"], got["time"]["optimizer"], fmt_ms),
        ("time step total", est["time"]["total"], got["time"]["total"], fmt_ms),
    ]
    if est["hardware"] == "cpu":  # on a GPU the host thread's CPU time is not the work
        rows += [
            ("  cpu time compute", est["time"]["compute"], got["cpu_time"]["compute"], fmt_ms),
            ("  cpu time optimizer", est["time"]["optimizer"], got["cpu_time"]["optimizer"],
             fmt_ms),
        ]
    # The proposal: against the CPU time of forward + backward (the wall time under dp=2
    # also holds the all-reduce waits, which a compute model does not cover).
    compute = got["cpu_time"]["compute"] if est["hardware"] == "cpu" else got["time"]["compute"]
    rows.append(("  per-op sum (proposal) vs compute", r["per_op_compute"]["seconds"], compute,
                 fmt_ms))
    if baseline is not None:
        exposed = got["time"]["total"] - baseline["measured"]["time"]["total"]
        rows.append(("time comm exposed", est["time"]["comm_exposed"], exposed, fmt_ms))
    if got["comm_alone"] is not None:
        rows.append(("time comm alone (no overlap)", r["predicted_comm_alone"],
                     got["comm_alone"], fmt_ms))
    kinds = sorted(set(est["comm"]) | set(got["comm"]))
    for kind in kinds:
        p = est["comm"].get(kind, {"count": 0, "payload_bytes": 0})
        m = got["comm"].get(kind, {"count": 0, "bytes": 0})
        rows.append((f"{kind} calls", p["count"], m["count"], lambda v: f"{v:.0f}"))
        rows.append((f"{kind} payload", p["payload_bytes"], m["bytes"],
                     lambda v: f"{v:,.0f} B"))
    if not kinds:
        rows.append(("collectives", 0, 0, lambda v: "none"))
    return [(term, f(p), f(m), error(p, m)) for term, p, m, f in rows]


def fmt_error(e: float | None) -> str:
    return "n/a" if e is None else f"{e:+.1f}%" if abs(e) >= 0.05 or e == 0 else f"{e:+.3f}%"


def report(results: list[dict], readings: dict, args: argparse.Namespace) -> str:
    lines = []
    summary: dict[str, list[float]] = {}
    by_key = {(r["model"], r["plan"], r["global_batch"]): r for r in results}
    for r in results:
        baseline = None
        if r["plan"] != "dp=1":
            baseline = by_key.get((r["model"], "dp=1", r["local_batch"]))
        shape = "/".join(str(v) for v in r["config"].values())
        title = (f"{r['model']} (n_layer/n_embd/n_head {shape}, "
                 f"{r['parameters']:,} parameters), {r['plan']}, global batch "
                 f"{r['global_batch']}x{r['seq']} (per rank {r['local_batch']})")
        rows = rows_of(r, baseline)
        lines += ["", f"#### {title}", "",
                  format_table(["term", "predicted", "measured", "error %"],
                               [[t, p, m, fmt_error(e)] for t, p, m, e in rows])]
        for term, _, _, e in rows:
            if e is not None:
                summary.setdefault(term, []).append(abs(e))
    lines += ["", "#### Mean absolute error per term, over the configurations", "",
              format_table(["term", "configurations", "mean abs error", "max abs error"],
                           [[t, str(len(v)), f"{statistics.mean(v):.2f}%", f"{max(v):.2f}%"]
                            for t, v in summary.items()])]
    profile = f"hardware profile '{args.hardware}' (datasheet constants)"
    if readings:
        profile = (f"cpu profile (1 thread): matmul {readings['matmul_flops'] / 1e9:.1f} GFLOP/s "
                   f"(512^3 fp32), attention {readings['attention_flops'] / 1e9:.1f} GFLOP/s "
                   f"(SDPA fwd+bwd, {readings['attention_flops'] / readings['matmul_flops']:.2f}"
                   f" x matmul), copy bandwidth {readings['memory_bandwidth'] / 1e9:.1f} GB/s, "
                   f"other ops {readings['elementwise_bandwidth'] / 1e9:.1f} GB/s ("
                   f"{readings['elementwise_bandwidth'] / readings['memory_bandwidth']:.2f} x copy), "
                   f"op overhead {1e6 * readings['op_overhead']:.2f} us, AdamW "
                   f"{1e6 * readings['optimizer_tensor_overhead']:.1f} us per tensor, "
                   f"gloo alpha {1e6 * readings['alpha']:.1f} us, link "
                   f"{readings['link_bandwidth'] / 1e9:.2f} GB/s; load average at calibration "
                   f"{readings['load_average']:.1f} on {readings['cores']} cores")
    return "\n".join([profile, *lines])


def default_hardware() -> str:
    """The estimate's profile for the device the runner will pick: cpu, or the GPU's."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).upper()
    return next((p for p in ("h200", "a100") if p.upper() in name), "h100")


def describe_machine(args: argparse.Namespace) -> str:
    if torch.cuda.is_available():
        device = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    else:
        device = "no GPU"
    return (f"torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} CPUs, {device}, "
            f"1 thread per rank, estimate on '{args.hardware}', median of {args.steps} steps "
            f"after {args.warmup} warm-up, load average {os.getloadavg()[1]:.1f} (5 min); "
            "error = (predicted - measured) / measured")


def driver(args: argparse.Namespace) -> int:
    if args.batch % 4:
        raise SystemExit("--batch must be a multiple of 4 (dp=2 and its dp=1 half-batch baseline)")
    args.hardware = args.hardware or default_hardware()
    with tempfile.TemporaryDirectory() as folder:
        readings = {}
        if args.hardware == "cpu":
            cache = args.profile_cache or Path(folder) / "profile"
            readings = calibrate(cache)
            print(f"calibrated the 1-thread cpu profile into {cache}: {readings}", flush=True)
        results = []
        for dp, batch in ((1, args.batch), (1, args.batch // 2), (2, args.batch)):
            print(f"torchrun dp={dp}, global batch {batch}:", flush=True)
            results += launch(args, dp, batch, Path(folder) / f"dp{dp}-b{batch}.json")
    order = {name: i for i, name in enumerate(args.models)}
    results.sort(key=lambda r: (order[r["model"]], r["plan"], -r["global_batch"]))
    text = report(results, readings, args)
    print("\n" + describe_machine(args))
    print(text)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": describe_machine(args), "profile": readings,
            "args": {k: str(v) for k, v in vars(args).items()}, "results": results,
        }, indent=1))
    return 0


def main() -> int:
    args = parse_args()
    if args.steps < 10:
        raise SystemExit("--steps must be >= 10")
    return worker(args) if args.worker is not None else driver(args)


if __name__ == "__main__":
    sys.exit(main())
