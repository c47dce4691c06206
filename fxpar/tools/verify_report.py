"""What `fxpar.verify` reports: each compared value's statistics, the tolerance, the first
node that differs.

Tolerance (fp32). Two correct programs differ by the order of their floating-point sums: a
tensor-parallel matmul adds its halves' partial products separately, data parallelism sums
per-rank gradients, microbatches sum per-chunk ones. That is a few ulps per sum, about 1e-7 of
the values' scale, amplified by depth; a wrong program (a missing reduction, a wrong slice)
is off by the size of the values themselves. So a value matches when

    max |parallel - reference|  <=  rtol * max |reference|  +  atol        rtol 1e-5, atol 1e-9

measured against the tensor's largest magnitude rather than element by element: an element
that is near zero in a tensor of ones carries the rounding of the ones, and element-wise
relative error there is noise. `atol` is only the floor for a tensor that is zero or nearly
so everywhere (an exactly-zero gradient computed as a difference of two sums): activation
gradients of a mean loss are small (1e-4 in the tests' GPT), so a larger floor would loosen
exactly those. On the tests' models (GPT, GPT-2, Llama, Qwen2 with sp, BERT; dp, tp, pp,
microbatches) the largest difference of a correct plan is under 10% of this tolerance, and a
dropped reduction or a wrong slice is off by a large fraction of the value itself. Integer and boolean values
must be equal. A value that should be the same on several ranks (Replicate) must also agree
across them within the same tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

RTOL, ATOL = 1e-5, 1e-9


@dataclass(frozen=True)
class Stats:
    """A value's shape, dtype, mean and standard deviation, as the report shows them."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    mean: float
    std: float

    @classmethod
    def of(cls, value: torch.Tensor) -> Stats:
        x = value.detach().double() if value.numel() else torch.zeros(1, dtype=torch.float64)
        return cls(tuple(value.shape), value.dtype, float(x.mean()), float(x.std()) if x.numel() > 1 else 0.0)

    def row(self, label: str) -> str:
        return f"    {label:<12} {str(list(self.shape)):<16} {str(self.dtype).replace('torch.', ''):<9} " \
               f"mean {self.mean: .6e}  std {self.std:.6e}"


@dataclass(frozen=True)
class Difference:
    """One node's value (or gradient) that differs beyond the tolerance."""

    what: str  # "forward value", "gradient", "parameter gradient"
    node: str
    module_path: str
    code: str  # the node as the reference graph writes it
    reference: Stats
    parallel: Stats
    max_abs: float
    max_relative: float  # max_abs over the reference's largest magnitude
    spread: float  # the largest difference between ranks' pieces that should be equal
    reason: str

    def __str__(self) -> str:
        where = self.module_path or "<root module>"
        return "\n".join([
            f"  first divergent: {self.what} of node {self.node} (module {where!r})",
            f"    {self.code}",
            self.reference.row("one device"),
            self.parallel.row("parallel"),
            f"    max abs difference {self.max_abs:.3e}, max relative {self.max_relative:.3e}; {self.reason}",
        ])


def node_code(node: fx.Node) -> str:
    """`node` as one short line: `layer_norm_2 = aten.layer_norm(add_2, [32], ...)`."""
    if node.op == "placeholder":
        return f"{node.name}: an input of the step"
    if node.op == "get_attr":
        return f"{node.name} = the parameter {node.target}"
    target = node.target
    name = str(target).removesuffix(".default") if isinstance(target, torch._ops.OpOverload) else getattr(
        target, "__name__", str(target))
    shown = [_argument(a) for a in node.args] + [f"{k}={_argument(v)}" for k, v in node.kwargs.items()]
    return f"{node.name} = {name}({', '.join(shown)})"


def _argument(value: object) -> str:
    if isinstance(value, fx.Node):
        return value.name
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_argument(v) for v in value) + "]"
    return repr(value)


def compare(reference: torch.Tensor, parallel: torch.Tensor, spread: float, *, rtol: float, atol: float) -> tuple[float, float, str] | None:
    """None when `parallel` matches `reference` (module doc); else (max abs difference, max
    relative, why)."""
    if reference.shape != parallel.shape:
        return float("inf"), float("inf"), f"shapes differ: {list(reference.shape)} against {list(parallel.shape)}"
    if not reference.is_floating_point():
        if torch.equal(reference, parallel.to(reference.dtype)) and spread == 0:
            return None
        return float("inf"), float("inf"), "integer values differ" if spread == 0 else "ranks hold different values"
    if reference.numel() == 0:
        return None
    scale = float(reference.detach().abs().max())
    allowed = rtol * scale + atol
    max_abs = float((parallel.detach().double() - reference.detach().double()).abs().max())
    relative = max_abs / scale if scale else float("inf") if max_abs else 0.0
    if max_abs > allowed:
        return max_abs, relative, f"tolerance {allowed:.1e} (rel {rtol:g} of its largest magnitude {scale:.3e} + abs {atol:g})"
    if spread > allowed:
        return max_abs, relative, (f"ranks that should hold the same value differ by {spread:.3e} "
                                   f"(tolerance {allowed:.1e})")
    return None


def tolerance_used(reference: torch.Tensor, parallel: torch.Tensor, *, rtol: float, atol: float) -> float:
    """max |parallel - reference| as a fraction of what the tolerance allows (0 for integers)."""
    if not reference.is_floating_point() or reference.numel() == 0 or reference.shape != parallel.shape:
        return 0.0
    allowed = rtol * float(reference.detach().abs().max()) + atol
    difference = float((parallel.detach().double() - reference.detach().double()).abs().max())
    return difference / allowed if allowed else 0.0 if difference == 0 else float("inf")


@dataclass
class VerifyReport:
    """The outcome of `fxpar.verify`: `equal`, or the first difference (`first`)."""

    plan: str
    loss_reference: float
    loss_parallel: float
    compared: dict[str, int] = field(default_factory=dict)  # what -> how many values matched or not
    # what -> how many values were not compared, and why (a value cp splits in no one-device order)
    left_out: dict[str, int] = field(default_factory=dict)
    first: Difference | None = None
    rtol: float = RTOL
    atol: float = ATOL
    closest: float = 0.0  # the largest fraction of its tolerance a matching value used

    @property
    def equal(self) -> bool:
        return self.first is None

    def __str__(self) -> str:
        counts = ", ".join(f"{n} {what}s" for what, n in self.compared.items())
        if self.left_out:
            counts += " (left out: " + ", ".join(f"{n} {why}" for why, n in self.left_out.items()) + ")"
        loss = f"loss {self.loss_parallel:.6f} against {self.loss_reference:.6f} on one device"
        if self.first is None:
            return (f"fxpar verify: plan '{self.plan}' equals one device: {counts} within rel "
                    f"{self.rtol:g} (+ abs {self.atol:g}; the largest difference was {self.closest:.0%} "
                    f"of its tolerance); {loss}")
        return "\n".join([
            f"fxpar verify: plan '{self.plan}' differs from one device ({loss})", str(self.first),
            f"  {counts} compared, this one last (forward values in graph order, then gradients in "
            "the order backward makes them, then the parameters' reduced gradients)",
        ])
