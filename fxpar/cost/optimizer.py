"""The optimizer step: its time, and the per-tensor state the ZeRO paper's formula leaves out.

Time of one step on one rank, for n parameter tensors holding P parameters:

    t = n x c + P x b / memory bandwidth

* c, seconds per tensor: torch's CPU optimizers are for-loops over the tensors (foreach
  kernels exist only for CUDA-like devices, `torch.optim.optimizer.
  _get_foreach_kernels_supported_devices`), each tensor paying a few op dispatches. For
  Adam/AdamW c is calibrated whole (`Hardware.optimizer_tensor_overhead`: an AdamW step over
  many small tensors with caches disturbed between steps, as training does); for SGD it is
  `Hardware.op_overhead` x the ops its loop runs per tensor (`_SGD_OPS_PER_TENSOR`);
* b, bytes per parameter (`BYTES_PER_PARAMETER`). For Adam/AdamW, 58: fitted to torch's
  for-loop AdamW on the CPU (28 us per tensor + 58 B per parameter at copy bandwidth fits
  the three GPT sizes of RESULTS.md to about 15%). Its kernels move 80 B per fp32 parameter
  (`_single_tensor_adam`: decay mul_ 8, lerp_ 12, mul_ 8 + addcmul_ 12 for the second
  moment, sqrt 8, div 8, add_ 8, addcdiv_ 16); less reaches memory because the temporaries
  stay in cache. A profile that measured Adam on its device gives its own b
  (`Hardware.optimizer_bytes_per_parameter`: the h200 profile's, fused AdamW). For SGD, the
  state read and written once (not measured).

Memory: torch.optim.Adam and AdamW keep `state["step"]` as a 0-dim fp32 tensor per parameter
tensor (torch/optim/adam.py `_init_group`, dtype `_get_scalar_dtype()`), 4 bytes each
(`STEP_COUNTER_BYTES`); `cost.memory.model_state_bytes` (bytes per parameter) has no place for
them, so the estimate adds them.
"""

from __future__ import annotations

import sympy

from fxpar.cost.hardware import Hardware

BYTES_PER_PARAMETER = {"adamw": 58, "adam": 58, "sgd-momentum": 20, "sgd": 12}
# torch's `_single_tensor_sgd`: the momentum buffer's mul_ and add_, then the parameter's add_.
_SGD_OPS_PER_TENSOR = {"sgd-momentum": 3, "sgd": 1}
STEP_COUNTER_BYTES = {"adamw": 4, "adam": 4, "sgd-momentum": 0, "sgd": 0}


def per_tensor_seconds(optimizer: str, device: Hardware) -> float:
    """c of the module doc: seconds one parameter tensor adds to a step."""
    if optimizer in ("adamw", "adam"):
        return device.optimizer_tensor_overhead
    return _SGD_OPS_PER_TENSOR[optimizer] * device.op_overhead


def optimizer_seconds(
    optimizer: str, tensors: int, parameters: sympy.Expr | int, device: Hardware
) -> sympy.Expr:
    """Seconds of one optimizer step over `tensors` tensors of `parameters` parameters."""
    b = BYTES_PER_PARAMETER[optimizer]
    if optimizer in ("adamw", "adam") and device.optimizer_bytes_per_parameter is not None:
        b = device.optimizer_bytes_per_parameter  # measured on that device (`cost.hardware`)
    return sympy.Float(tensors * per_tensor_seconds(optimizer, device)) + sympy.sympify(
        b * parameters
    ) / sympy.Float(device.memory_bandwidth)
