#!/usr/bin/env bash
# Every check that needs a CUDA device, in one command (a GPU machine's session runs it once):
#
#     bash benchmarks/gpu_check.sh OUT_DIR
#
# 1. the GPU test tier (`pytest -m gpu`: NCCL at world 1; gloo ranks sharing one GPU under
#    data parallelism and ZeRO-1/2/3), exact against one device;
# 2. ZeRO-3 at world 1 against eager bf16 and FSDP2 on GPT-2 124M, batch 16x1024, with the
#    allocator's peak against the estimate (`bench_gpu_zero3.py`, its own targets);
# 3. the cost model's terms, predicted against measured, on the GPU (`bench_cost_model.py`);
# 4. compiled mode against torch.compile on GPT-2 124M, 350M and 774M: step, MFU, compile time,
#    the allocator's peak against the estimate (`bench_gpu_compiled.py`);
# and then every number beside its target in one table (`gpu_summary.py`).
#
# Part 4 is new and has not run on a GPU: each of its shapes compiles three times (two fxpar
# plans at the first shape, one after), about half a minute each on an H200 by torch.compile's
# 33 s for 124M (shared/measurements/h200-2026-12-04/mfu.json), so it may take the whole run
# past six minutes; GPU_SHAPES="124M" narrows it.
#
# The machine may be offline: fxpar is installed from this checkout without its dependencies
# (torch, sympy, numpy, pyyaml and safetensors are expected there already; the graphviz
# package only draws pictures, which no step here does). Each part's log is written under
# OUT_DIR, and the exit status is the number of parts that failed.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1

python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 100
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" \
    | tee -a "$out/gpu.txt"

failed=0
timeout 240 python3 -m pytest -q -m gpu tests 2>&1 | tee "$out/gpu_tests.log" || failed=$((failed + 1))
timeout 240 torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpu_zero3.py \
    --json "$out/gpu_zero3.json" 2>&1 | tee "$out/gpu_zero3.log" || failed=$((failed + 1))
timeout 180 python3 benchmarks/bench_cost_model.py --models small --steps 10 --backend gloo \
    --json "$out/cost_model.json" 2>&1 | tee "$out/cost_model.log" || failed=$((failed + 1))
timeout 420 torchrun --standalone --nproc-per-node 1 benchmarks/bench_gpu_compiled.py \
    --shapes ${GPU_SHAPES:-124M 350M 774M} --json "$out/gpu_compiled.json" 2>&1 | tee "$out/gpu_compiled.log" || failed=$((failed + 1))
(cd benchmarks && python3 gpu_summary.py "$out") | tee "$out/summary.txt"
echo "gpu_check: $failed part(s) failed"
exit $failed
