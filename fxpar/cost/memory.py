"""Model-state memory per rank: parameters, gradients and optimizer state, by ZeRO stage.

Bytes per parameter (Rajbhandari et al. 2020, "ZeRO", Sec. 3.1 and 5):

    precision    weights  gradients  optimizer state
    fp32            4         4      Adam 8 (m, v); SGD+momentum 4; SGD 0
    bf16-mixed      2         2      Adam 12 (fp32 master, m, v); SGD+momentum 8; SGD 4

so mixed-precision Adam holds (2 + 2 + 12) P = 16P bytes under plain data parallelism.
ZeRO shards over the N data-parallel ranks: stage 1 the optimizer state, stage 2 also the
gradients, stage 3 also the weights, giving 4P + 12P/N, 2P + 14P/N and 16P/N (Sec. 5).
`P` may be a number or a sympy symbol; shares are exact rationals.

The paper's 2 bytes of gradients are 16-bit gradients reduced in 16 bits. fxpar's bf16
gradients (`passes.mixed_precision`) are reduced over dp in the plan's `reduce_dtype`
(FSDP2's `MixedPrecisionPolicy.reduce_dtype`, default fp32); DDP and ZeRO-1 keep the bf16
bucket (2P; an fp32 reduction stages one bucket at a time in fp32 and rounds the sum back),
and the reduced shard ZeRO keeps is in `reduce_dtype`: ZeRO-1 adds it beside the bucket (4P/N
in fp32, a view of the bucket in bf16), ZeRO-2 and 3 keep only it (4P/N or 2P/N). With
dp = 1 nothing is reduced: 2P. So bf16-mixed Adam with the default fp32 reduction holds
2P + 2P + 12P without ZeRO, 2P + (2P + 4P/N) + 12P/N with ZeRO-1, 2P + 4P/N + 12P/N with
ZeRO-2. ZeRO-3 with reduce_dtype=bf16 holds the paper's 2P/N + 2P/N + 12P/N; with fp32 it
stores each piece in fp32 as FSDP2 does, the piece being its own master (`passes.zero3`),
with fp32 gradients and the fp32 optimizer's state: 4P/N + 4P/N + 8P/N (Adam), the same
16P/N in all.

`peak_bytes` puts model state, saved activations and backward's workspace together into the
step's peak. When gradients exist decides where it is:

* gradients freed between steps (`zero_grad(set_to_none=True)`, fxpar's dp=1): backward
  starts with every activation saved and no gradient yet, and ends with every gradient and
  no activation, so the peak is params + optimizer + max(activations + workspace, grads);
* gradients that live all step (fxpar's dp > 1 keeps them in gradient-bucket buffers that
  `.grad` views; gradient accumulation keeps them across microbatches): params + optimizer
  + grads + activations + workspace;
* ZeRO-2 (dp > 1): the reduced shards (`grads`) live all step, and the whole gradients
  (4P fp32, 2P bf16) exist from a bucket's first gradient in backward until the step program
  waits for its reduction (`runtime.state.gradient_buckets`): after the last backward when it
  reduces once per step, after each microbatch's backward when it reduces per microbatch
  (`fxpar.plan.zero_reduction`). Reduced once per step over several microbatches they
  accumulate from the first backward and are kept through the later forwards: params +
  optimizer + grads + whole + activations + workspace. Otherwise backward allocates the
  buckets one by one while it frees the activations, and nothing is freed before it ends:
  its first bucket comes while every activation is saved, its last when only the gradients
  are left, so the peak is params + optimizer + grads + max(activations + workspace + the
  largest bucket, whole + the other microbatches' activations in flight). Between those two
  ends it is a bound only where a layer's gradients come as its activations go, as in a
  transformer's backward. With one bucket (a small model) it is the sum of both (measured,
  small GPT at dp=4: 16.99 MiB against 17.79 predicted; max(activations + workspace, whole),
  which this replaced, said 14.60);
* ZeRO-3 reducing once per step (several microbatches): each layer's whole gradients
  accumulate in the reduce dtype (4P fp32) from the first backward to the last, beside the
  last microbatch's activations: params + optimizer + grads + whole + activations +
  workspace.

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
    reduce_dtype: str = "fp32",
) -> dict[str, sympy.Expr]:
    """Bytes of `params`, `grads` and `optimizer` state one rank holds (see module doc);
    `reduce_dtype` ("fp32" or "bf16") is what bf16-mixed reduces gradients in."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZERS)}")
    P = sympy.sympify(parameters)
    share = 1 / sympy.sympify(dp)
    weights = _WEIGHT_BYTES[precision] * P
    grads = _WEIGHT_BYTES[precision] * P
    state = _OPTIMIZER_BYTES[(precision, optimizer)] * P
    if precision == "bf16-mixed" and zero >= 3 and share != 1 and reduce_dtype == "fp32":
        return model_state_bytes(P, precision="fp32", optimizer=optimizer, zero=zero, dp=dp)
    if precision == "bf16-mixed":
        grads = _mixed_gradient_bytes(P, share, zero=zero, reduced=_REDUCED_BYTES[reduce_dtype])
    elif zero >= 2:
        grads = grads * share
    return {
        "params": weights * share if zero >= 3 else weights,
        "grads": grads,
        "optimizer": state * share if zero >= 1 else state,
    }


_REDUCED_BYTES = {"fp32": 4, "bf16": 2}


def _mixed_gradient_bytes(P, share, *, zero: int, reduced: int) -> sympy.Expr:
    """bf16 gradients reduced in `reduced`-byte elements (module doc)."""
    if share == 1 or zero == 0:
        return 2 * P
    if zero == 1:
        return 2 * P + (reduced * P * share if reduced != 2 else 0)
    return reduced * P * share


def peak_bytes(
    state: dict[str, sympy.Expr],
    activations: sympy.Expr,
    workspace: sympy.Expr,
    *,
    parameters: sympy.Expr | int,
    precision: str,
    zero: int,
    dp: int,
    microbatches: int,
    reduce_per_microbatch: bool = False,
    released: sympy.Expr | None = None,
    largest_bucket: sympy.Expr | int | None = None,
    reduce_dtype: str = "fp32",
) -> sympy.Expr:
    """Peak bytes of one rank over a step (see module doc); `state` as `model_state_bytes` for
    the rank's `parameters`, the plan's fields as named; `reduce_per_microbatch`: ZeRO-2/3
    reduce-scatter each microbatch's gradients (`fxpar.plan.zero_reduction`); `released`: the
    activations one microbatch's backward frees (default all of them: one in flight);
    `largest_bucket`: bytes of the rank's largest whole gradient bucket (default: one bucket
    holds them all)."""
    held = state["params"] + state["optimizer"]
    once = microbatches > 1 and not reduce_per_microbatch  # the whole gradients accumulate all step
    if zero == 2 and dp > 1:  # the reduced shards persist; the whole buckets live through backward
        whole = model_state_bytes(parameters, precision=precision, optimizer="sgd", zero=0, dp=1)["grads"]
        if once:  # accumulated over the step's backwards, kept through its forwards
            return held + state["grads"] + whole + activations + workspace
        first = whole if largest_bucket is None else sympy.Min(largest_bucket, whole)
        kept = activations - (activations if released is None else released)  # other microbatches'
        return held + state["grads"] + sympy.Max(activations + workspace + first, kept + whole)
    if zero == 3 and dp > 1 and once:  # each layer's whole gradients, summed in the reduce dtype
        whole = (_REDUCED_BYTES[reduce_dtype] if precision == "bf16-mixed" else 4) * sympy.sympify(parameters)
        return held + state["grads"] + whole + activations + workspace
    if dp > 1 or microbatches > 1:
        return held + state["grads"] + activations + workspace
    return held + sympy.Max(activations + workspace, state["grads"])
