"""Fit the `h200` hardware profile on part B of the H200 measurements, and only on it.

    python benchmarks/fit_h200_profile.py      # writes fxpar/cost/measured/h200.json

Part B of `benchmarks/data/h200-2026-12-04.json` (one H200, torch 2.11, bf16 unless said) holds
microbenchmarks: matmuls of ten shapes, causal flash attention forward and backward at four,
the bandwidth of a copy, an add, a GELU and a layer norm's forward, the fp32 cross-entropy
over GPT-2's logits forward and backward, a chain of tiny ops with autograd, and AdamW
steps (foreach and fused) over many small and a few large tensors. Each profile field comes
from them by one stated rule (below); part A, the training steps, is what the profile is
then judged on (`bench_h200_part_a.py`), never fitted on.

Rules:

* matmul_tables: the ten shapes' rates, a bf16 table (`cost.matmul_table`: each matmul of a
  step, its backward's included, priced at the rate interpolated at its shape);
  matmul_efficiency: all matmul FLOPs over all their seconds (the rate a mix of those shapes
  runs at), over the datasheet's 989 TFLOP/s, for MFU and the fp32 matmuls;
* attention_efficiency: forward + backward FLOPs (3 x 4 b h s^2 d, as `cost.ops` counts)
  over their seconds, all four shapes together, over that matmul rate;
* bandwidths, bytes as `cost.ops` counts them (inputs plus output; backward twice forward):
  pointwise the add's, activation the GELU's, norm the layer norm's forward, copy the
  copy's; loss from the cross-entropy: the step cast the bf16 logits to fp32 (a copy, 2 + 4
  bytes per logit, 3 x for forward and backward, at the copy's bandwidth), the rest is the
  fp32 cross-entropy's 3 x 4 bytes per logit;
* memory_bandwidth: the copy's;
* op_overhead: half the chain's seconds per op (one forward op and one backward node);
  host_overlap: a GPU runs kernels while the host dispatches;
* optimizer (fused AdamW, what `runner.optimizer` uses on CUDA): per tensor from the steps
  over 256 tensors of 1k elements, bytes per parameter from the step over 124M parameters
  in 8 tensors, less their per-tensor time. The foreach readings are kept in `measured`
  (the optimizer part A ran, `bench_h200_part_a.py`).
* links: the nominal NVLink / InfiniBand numbers of the `h100` profile (part B measured no
  collective: one GPU).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

from fxpar.cost.hardware import PROFILES, Hardware
from fxpar.cost.matmul_table import MatmulTable
from fxpar.cost.profile_files import save_profile

DATA = Path(__file__).parent / "data" / "h200-2026-12-04.json"
OUT = Path(__file__).parents[1] / "fxpar" / "cost" / "measured" / "h200.json"
PEAK = {"bf16": 989e12, "fp32": 67e12}  # H200 SXM dense, as the H100 (same compute die)


def fit(part_b: dict) -> Hardware:
    matmuls = part_b["matmul_bf16"].items()
    flops = sum(2 * _prod(shape) for shape, _ in matmuls)
    matmul_rate = flops / sum(m["s"] for _, m in matmuls)
    attention = part_b["sdpa_causal_bf16"].items()
    attention_flops = sum(3 * 4 * b * h * s * s * d for b, h, s, d in (_dims(shape) for shape, _ in attention))
    attention_rate = attention_flops / sum(a["fwdbwd_s"] for _, a in attention)
    e = part_b["elementwise"]
    copy = e["copy_GBps"] * 1e9
    logits = e["cross_entropy_bytes_logits"] / 2  # bf16 logits: elements
    cast = 3 * (2 + 4) * logits / copy
    loss = 3 * 4 * logits / (e["cross_entropy_fp32_fwdbwd_s"] - cast)
    small_fused, big_fused = part_b["adamw_fused_s_per_tensor_1k"], part_b["adamw_fused_s_124M_fp32"]
    small_foreach, big_foreach = part_b["adamw_foreach_s_per_tensor_1k"], part_b["adamw_foreach_s_124M_fp32"]
    per_parameter = lambda big, small: (big - 8 * small) * copy / 124e6  # noqa: E731
    return replace(
        PROFILES["h100"],
        name="h200",
        peak_flops=PEAK,
        matmul_efficiency=matmul_rate / PEAK["bf16"],
        matmul_tables={"bf16": MatmulTable(tuple((*_dims(shape), 2 * _prod(shape) / m["s"]) for shape, m in matmuls))},
        attention_efficiency=attention_rate / matmul_rate,
        memory_bandwidth=copy,
        elementwise_efficiency=1.0,
        bandwidths={"pointwise": e["add_GBps"] * 1e9, "activation": e["gelu_GBps"] * 1e9,
                    "norm": e["layer_norm_fwd_GBps"] * 1e9, "copy": copy, "loss": loss},
        op_overhead=part_b["op_overhead_s_per_fwd_plus_bwd_op"] / 2,
        host_overlap=True,
        optimizer_tensor_overhead=small_fused,
        optimizer_bytes_per_parameter=per_parameter(big_fused, small_fused),
        measured={"matmul_flops": matmul_rate, "attention_flops": attention_rate, "loss_bandwidth": loss,
                  "foreach_optimizer_tensor_overhead": small_foreach,
                  "foreach_optimizer_bytes_per_parameter": per_parameter(big_foreach, small_foreach)},
    )


def _dims(shape: str) -> list[int]:
    return [int(d) for d in shape.split("x")]


def _prod(shape: str) -> int:
    return math.prod(_dims(shape))


def main() -> None:
    profile = fit(json.loads(DATA.read_text())["B"])
    OUT.parent.mkdir(exist_ok=True)
    print(f"wrote {save_profile(profile, OUT)}")
    print(f"matmul {profile.matmul_rate('bf16') / 1e12:.0f} TFLOP/s, attention {profile.attention_rate('bf16') / 1e12:.0f}, "
          + ", ".join(f"{k} {v / 1e9:.0f} GB/s" for k, v in profile.bandwidths.items())
          + f", op {profile.op_overhead * 1e6:.1f} us, AdamW (fused) {profile.optimizer_tensor_overhead * 1e6:.1f} us "
          f"per tensor + {profile.optimizer_bytes_per_parameter:.0f} B per parameter")


if __name__ == "__main__":
    main()
