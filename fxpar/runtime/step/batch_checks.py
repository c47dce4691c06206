"""A step's batch, checked against what the program was compiled for, before any collective.

`runner.step` arranges the batch in the graph's input order (`CapturedGraph.arrange`, which
refuses a missing or extra input) and then calls `check_batch` with the program's
`BatchRules` (`fxpar.frontend.batch_rules`, read off the captured graph once per runner). Each rule
broken is a BatchError naming the input as the example named it, what the program expects,
what it got, and a fix:

    rule                                   torch's error without it
    a tensor of the example's rank         a view or matmul shape error deep in the forward
    of its dtype                           "expected scalar type Long but found Float"
    on the runner's device                 a device mismatch in the first op (or a meta tensor
                                           that runs the whole step on no data)
    each fixed dim of the example's size   a shape error in the first op that reads it
    no symbolic dim empty                  a 0-row batch: NaN loss (0 / 0 valid targets)
    inputs that share a symbol agree       a reshape error in the loss
    seq within the position table          IndexError in torch.embedding
    labels in [0, vocabulary) or ignored   IndexError in nll_loss on one device and under dp;
                                           under tp a finite, wrong loss (`passes.tensor_parallel.vocab_loss`)

The checks run on every rank on the batch it was given: the ranks of a tp or pp group all
hold the same batch and all raise; under dp a rank raises for its own share, and its peers
meet the step agreement (`runtime.step.agreement`) at their next step.

Cost: the shape, dtype and device checks read metadata only (microseconds). The label check
is one pass over each label input (a few elementwise kernels fused by size, then `any`), and
on CUDA one host synchronisation per label input, which waits for the work queued before the
step (the last optimizer step). On the example GPT on CPU (16 x 128 tokens, one thread) all
the checks take 0.02 ms against a 170 ms step, 0.01% (benchmarks/bench_batch_checks.py).
"""

from __future__ import annotations

import torch

from fxpar.errors import BatchError, shown
from fxpar.frontend.batch_rules import BatchRules, InputRule, LabelRule, SizeBound


def check_batch(rules: BatchRules, inputs: tuple, *, device: torch.device) -> None:
    """Raise BatchError for the first rule `inputs` (a step's batch in graph order, as
    `arrange` returns it) breaks, on a runner on `device`; module doc."""
    for rule, tensor in zip(rules.inputs, inputs, strict=True):
        check_input(rule, tensor, device=device)
    check_shared_sizes(rules.inputs, inputs)
    for bound in rules.bounds:
        check_bound(bound, rules.inputs, inputs)
    for label in rules.labels:
        check_labels(label, rules.inputs[label.position], inputs[label.position])


def check_input(rule: InputRule, tensor: object, *, device: torch.device) -> None:
    """One input's kind, rank, dtype, device and sizes against the example's."""
    expected = f"{rule.dtype} of shape {_shape_text(rule.sizes)}"
    if not isinstance(tensor, torch.Tensor):
        raise BatchError(f"{rule.label} is {shown(tensor)} ({type(tensor).__name__}); the program takes a "
                         f"tensor there: {expected}, as in the example. Fix: pass it as a tensor")
    if tensor.dim() != len(rule.sizes):
        raise BatchError(
            f"{rule.label} has {tensor.dim()} dims, shape {tuple(tensor.shape)}; the program was compiled for "
            f"{len(rule.sizes)}: {expected}. Fix: pass {rule.name} shaped as the example was "
            f"(its dim 0 the batch{', dim 1 the sequence' if len(rule.sizes) > 1 else ''})"
        )
    if tensor.dtype != rule.dtype:
        raise BatchError(f"{rule.label} is {tensor.dtype}; the program was compiled for {expected}. "
                         f"Fix: {rule.name}.to({rule.dtype})")
    if tensor.device.type != device.type or device.index is not None and tensor.device.index != device.index:
        raise BatchError(f"{rule.label} is on device {tensor.device}, this runner on {device}. Fix: move the "
                         f"batch to the runner's device ({rule.name}.to(runner.device)) before runner.step")
    for dim, (size, wanted) in enumerate(zip(tensor.shape, rule.sizes)):
        if isinstance(wanted, int) and size != wanted:
            raise BatchError(
                f"{rule.label} has size {size} in dim {dim}, shape {tuple(tensor.shape)}; the program fixed that "
                f"dim to {wanted}, the example's ({expected}). Fix: give every batch size {wanted} there "
                + ("(capture keeps only dims 0 and 1 free: the batch and the sequence)" if dim > 1 else
                   "(the model read this size as a constant when it was captured)")
            )
        if size == 0:
            raise BatchError(
                f"{rule.label} is empty: dim {dim} ({wanted}) has size 0, shape {tuple(tensor.shape)}; a step "
                f"needs at least one {'row' if dim == 0 else 'element'} there (a mean over no targets is "
                "0 / 0). Fix: skip empty batches before runner.step, on every rank alike"
            )


def check_shared_sizes(rules: tuple[InputRule, ...], inputs: tuple[torch.Tensor, ...]) -> None:
    """Dims that the example sized alike under one symbol (every input's dim 0 is `batch`)
    agree: the first input holding a symbol sets it."""
    first: dict[str, tuple[InputRule, int, int]] = {}
    for rule, tensor in zip(rules, inputs):
        for dim, (size, symbol) in enumerate(zip(tensor.shape, rule.sizes)):
            if isinstance(symbol, int):
                continue
            setter, setter_dim, setter_size = first.setdefault(symbol, (rule, dim, size))
            if size != setter_size:
                raise BatchError(
                    f"{rule.label} has size {size} in dim {dim} ({symbol}), {setter.label} {setter_size} in dim "
                    f"{setter_dim}: the program reads both as {symbol}, as they were alike in the example. Fix: "
                    f"give both the same {symbol}, or compile from an example where they differ (so that "
                    "capture keeps them apart)"
                )


def check_bound(bound: SizeBound, rules: tuple[InputRule, ...], inputs: tuple[torch.Tensor, ...]) -> None:
    """Every dim of symbol `bound.symbol` at most `bound.most`."""
    for rule, tensor in zip(rules, inputs):
        for dim, (size, symbol) in enumerate(zip(tensor.shape, rule.sizes)):
            if symbol == bound.symbol and size > bound.most:
                raise BatchError(
                    f"{rule.label} has {size} positions in dim {dim} ({symbol}), more than the model's "
                    f"{bound.most}: {bound.reason}. Fix: cut sequences to at most {bound.most} tokens, or build "
                    "the model with a longer position table (block_size, max_position_embeddings)"
                )


def check_labels(rule: LabelRule, input_rule: InputRule, labels: torch.Tensor) -> None:
    """Every label a class in [0, vocabulary) or the ignore index: one pass, and on CUDA one
    host synchronisation (module doc); the first offender is located only when there is one."""
    bad = labels.ge(rule.vocabulary).logical_or_(labels.lt(0)).logical_and_(labels.ne(rule.ignore_index))
    if not bad.any():  # the one synchronisation
        return
    where = bad.nonzero()
    first = tuple(where[0].tolist())
    at = f"{input_rule.name}[{', '.join(map(str, first))}] = {labels[first].item()}"
    more = f", and {len(where) - 1} more" if len(where) > 1 else ""
    raise BatchError(
        f"{input_rule.label} holds a label outside the vocabulary: {at}{more} (indices into the batch this "
        f"rank's step was given); the loss ({rule.loss}) takes a class in [0, {rule.vocabulary}) or the "
        f"ignore index {rule.ignore_index}. Fix: map such tokens into the vocabulary, or set them to "
        f"{rule.ignore_index} so that the loss skips them"
    )


def _shape_text(sizes: tuple[int | str, ...]) -> str:
    """`(batch, seq, 4)`, `(batch,)`: a shape of sizes and symbols as Python prints a tuple."""
    return f"({', '.join(map(str, sizes))}{',' if len(sizes) == 1 else ''})"
