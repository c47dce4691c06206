"""Model-state memory per rank: parameters, gradients and optimizer state, by ZeRO stage.

Bytes per parameter (Rajbhandari et al. 2020, "ZeRO", Sec. 3.1 and 5):

    precision    weights  gradients  optimizer state
    fp32            4         4      Adam 8 (m, v); SGD+momentum 4; SGD 0
    bf16-mixed      2         2      Adam 12 (fp32 master, m, v); SGD+momentum 8; SGD 4

so mixed-precision Adam holds (2 + 2 + 12) P = 16P bytes under plain data parallelism.
ZeRO shards over the N data-parallel ranks: stage 1 the optimizer state, stage 2 also the
gradients, stage 3 also the weights, giving 4P + 12P/N, 2P + 14P/N and 16P/N (Sec. 5).
`P` may be a number or a sympy symbol; shares are exact rationals.

`peak_bytes` puts model state, saved activations and backward's workspace together into the
step's peak. When gradients exist decides where it is:

* gradients freed between steps (`zero_grad(set_to_none=True)`, fxpar's dp=1): backward
  starts with every activation saved and no gradient yet, and ends with every gradient and
  no activation, so the peak is params + optimizer + max(activations + workspace, grads);
* gradients that live all step (fxpar's dp > 1 keeps them in gradient-bucket buffers that
  `.grad` views; gradient accumulation keeps them across microbatches): params + optimizer
  + grads + activations + workspace.

Measured on the CPU, the peak of every configuration of RESULTS.md is at the start of
backward, where this formula puts it.
"""

from __future__ import annotations

from typing import Literal

import sympy

Optimizer = Literal["adamw", "adam", "sgd", "sgd-momentum"]
OPTIMIZERS: tuple[str, ...] = ("adamw", "adam", "sgd", "sgd-momentum")

_WEIGHT_BYTES = {"fp32": 4, "bf16-mixed": 2}
_OPTIMIZER_BYTES = {
    ("fp32", "adamw"): 8, ("fp32", "adam"): 8, ("fp32", "sgd-momentum"): 4, ("fp32", "sgd"): 0,
    ("bf16-mixed", "adamw"): 12, ("bf16-mixed", "adam"): 12,
    ("bf16-mixed", "sgd-momentum"): 8, ("bf16-mixed", "sgd"): 4,
}


def model_state_bytes(
    parameters: sympy.Expr | int,
    *,
    precision: str,
    optimizer: str,
    zero: int,
    dp: int | sympy.Expr,
) -> dict[str, sympy.Expr]:
    """Bytes of `params`, `grads` and `optimizer` state one rank holds (see module doc)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    P = sympy.sympify(parameters)
    share = 1 / sympy.sympify(dp)
    weights = _WEIGHT_BYTES[precision] * P
    grads = _WEIGHT_BYTES[precision] * P
    state = _OPTIMIZER_BYTES[(precision, optimizer)] * P
    return {
        "params": weights * share if zero >= 3 else weights,
        "grads": grads * share if zero >= 2 else grads,
        "optimizer": state * share if zero >= 1 else state,
    }


def peak_bytes(
    state: dict[str, sympy.Expr],
    activations: sympy.Expr,
    workspace: sympy.Expr,
    *,
    grads_persist: bool,
) -> sympy.Expr:
    """Peak bytes of one rank over a step (see module doc); `state` as `model_state_bytes`."""
    held = state["params"] + state["optimizer"]
    if grads_persist:
        return held + state["grads"] + activations + workspace
    return held + sympy.Max(activations + workspace, state["grads"])
