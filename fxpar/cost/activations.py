"""Activation memory: the bytes autograd saves for backward, as a formula in batch and seq.

Rather than a table of what each op saves (which differs by kernel: PyTorch's CPU flash
attention saves a logsumexp where the math kernel saves the full attention matrix), fxpar
asks autograd itself. It runs the captured graph's forward once under export's own
`FakeTensorMode`, whose inputs have *symbolic* batch and sequence sizes, inside
`torch.autograd.graph.saved_tensors_hooks`: every tensor autograd packs for backward passes
through the hook with a symbolic size. Storages are counted once (a saved view shares its
base's memory) and parameters are left out (they are counted as model state), and so is what
an op saves whose value never reaches the loss (a router's group scores, read only for the
indices they choose): autograd frees it when forward drops the value (`ir.graph_paths`). The sum is an
exact formula, e.g. for a 2-layer GPT with h=32 on the CPU: 4944 batch seq + 8 seq + 4 bytes.

No tensor is allocated: a 96-layer GPT-3 runs in seconds on a laptop.

The fake forward runs every tensor on one device: the capture's, which its example inputs
carry, whatever device the rank's state was bound to since. The bytes saved are shapes and
dtypes, which do not move with the device, and mixing the two (a model bound to `cuda:0`,
inputs captured on the CPU) is an error fake tensors raise; nor can autograd record fake CUDA
tensors in a torch built without CUDA, where plans for a GPU cluster are made.

Under activation checkpointing (`fxpar.ir.recompute_regions`) the fake forward follows the
runtime's recomputation call by call (`recompute_regions.segments`, the runtime's own cut):
what a recomputed run saves is not counted (torch's checkpoint drops it), and the run's
tensor inputs are, as the checkpoint keeps them to recompute from, where one of its outputs
needs a gradient. So `checkpoint=full` leaves each block's input and whatever ops outside
the blocks save (embeddings, the final norm, the head and the loss), and `selective` drops
what the attention core saves (Korthikanti et al. 2022, Sec. 5).

Per rank, `rank_activation_bytes` runs the same fake forward over the modules the rank runs
(`program.stage_modules`: its tensor-parallel shards, its pipeline stages, the loss divided
by the global count, each collective's output kept where it cuts a block's recomputation),
leaving out the batch the step is given, as the runtime's meter does
(`runtime.step.saved_tensors`); times the microbatches its schedule keeps in flight, that is the
estimate's `memory.activations`.

The saved bytes are not the whole of backward's memory: what backward allocates beside them
is `cost.workspace`'s.
"""

from __future__ import annotations

import contextlib
import operator

import sympy
import torch
import torch.fx as fx
from torch._C import DispatchKey
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode

from fxpar.cost.compiled_activations import compiled_saved_bytes
from fxpar.cost.compiled_graphs import module_graphs
from fxpar.cost.input_pieces import Pieces, boundary_pieces, piece_values
from fxpar.cost.memo import memoised, module_key
from fxpar.frontend.trace import CapturedGraph
from fxpar.ir import meta
from fxpar.ir.compiled_program import CompiledProgram
from fxpar.ir.graph_paths import nodes_reaching_output
from fxpar.ir.recompute_regions import block_lists, region_labels, segment_outputs, segments
from fxpar.ops.distributed import shares_storage_at_run_time
from fxpar.ops.parameter_gathers import OP as GATHER_OP, REGATHER


_GATHER, _REGATHER = GATHER_OP.overload, REGATHER.overload
_RECORDING_KEYS = {DispatchKey.Autograd, DispatchKey.CompositeImplicitAutograd}


def _symbolic_in_python(target) -> bool:
    """Whether the fake forward runs op `target` under the python dispatcher, as export traced
    it. Some C++ kernels read concrete sizes: on symbolic ones they fail (Bloom's baddbmm,
    expanding its ALiBi bias) or fix them to the example's (Hugging Face's loss pads its labels,
    and the target cross entropy saved was then the global batch's, whatever the rank's); the
    python dispatcher runs their meta functions in Python, symbolically. Not for an op with a
    Python kernel of its own at the autograd or composite key (dropout): that kernel records
    other ops, and saves other tensors, than the C++ kernel the runtime runs."""
    return isinstance(target, torch._ops.OpOverload) and not _RECORDING_KEYS & set(target.py_kernels)


class _FakeStateInterpreter(fx.Interpreter):
    """Runs the graph with fake stand-ins for its parameters and buffers; the nodes of a
    recomputed run save nothing, and the run's inputs go to `kept` (module doc)."""

    def __init__(self, gm: fx.GraphModule, state: dict[str, torch.Tensor], runs: list[list[fx.Node]],
                 kept: list[torch.Tensor], device: torch.device, observe=None):
        super().__init__(gm)
        self.observe = observe  # called with (node, its inputs' values, its value) after each op
        self.state = state
        self.device = device
        self.run_of = {node: run for run in runs for node in run}
        self.kept = kept
        self.inputs: dict[fx.Node, torch.Tensor] = {}  # of the run being interpreted
        # ZeRO-3 with re-gathering packs what is saved of a layer gathered again for backward
        # as a recipe (`runtime.state.parameter_gatherer`): model state, not activations, as the
        # meter counts. The root's layer is not gathered again: what it saves counts.
        self.regathered = {tuple(n.args[1]) for n in gm.graph.nodes if n.target is _REGATHER}
        self.gathered: list[torch.Tensor] = []
        self.running: fx.Node | None = None  # whose op autograd is saving for

    def get_attr(self, target, args, kwargs):
        return self.state[target]

    def call_function(self, target, args, kwargs):
        if isinstance(kwargs.get("device"), torch.device):  # a graph constant, placed by bind
            kwargs = {**kwargs, "device": self.device}
        if not _symbolic_in_python(target):
            return super().call_function(target, args, kwargs)
        with enable_python_dispatcher():
            return super().call_function(target, args, kwargs)

    def run_node(self, node: fx.Node):
        self.running = node
        value = self._run_node(node)
        if self.observe is not None and node.op == "call_function":
            self.observe(node, [self.env[a] for a in node.all_input_nodes], value)
        source = node.args[0] if node.op == "call_function" and node.args else None
        if isinstance(source, fx.Node) and isinstance(x := self.env.get(source), torch.Tensor) \
                and shares_storage_at_run_time(node, x):
            return x.view_as(x)  # as the runtime's op returns it: on its input's storage
        return value

    def _run_node(self, node: fx.Node):
        run = self.run_of.get(node)
        if run is None:
            value = super().run_node(node)
            if node.target is _GATHER and tuple(node.args[0]) in self.regathered:
                self.gathered += [v for v in value if isinstance(v, torch.Tensor)]
            return value
        if node is run[0]:
            self.inputs = {}
        inside = set(run)
        for source in node.all_input_nodes:  # read now: the interpreter frees values after use
            if source not in inside and isinstance(value := self.env[source], torch.Tensor):
                self.inputs.setdefault(source, value)
        with torch.autograd.graph.saved_tensors_hooks(lambda tensor: tensor, lambda tensor: tensor):
            value = super().run_node(node)
        if node is run[-1]:
            outputs = [value if n is node else self.env[n] for n in segment_outputs(run)]
            if any(isinstance(o, torch.Tensor) and o.requires_grad for o in outputs):
                self.kept += [(value, node) for value in self.inputs.values()]
        return value


def saved_in_flight(schedule) -> tuple[int, ...]:
    """Per pipeline rank, the most (stage, microbatch) forwards whose saved tensors are held:
    run (F) and not yet backward (B). A split schedule's B frees them too, as autograd does;
    W's store then keeps only its linears' inputs and output gradients
    (`runtime.step.weight_gradients`), which `memory.activations` does not count (nor the meter).
    `simulation.Simulation.peak_in_flight` counts to W instead: the schedule's own bound."""
    return most_open(schedule, opened_by="F", closed_by="B")


def most_open(schedule, *, opened_by: str, closed_by: str) -> tuple[int, ...]:
    """Per pipeline rank, the most (stage, microbatch) whose `opened_by` action has run on
    its row and whose `closed_by` action has not yet."""
    peaks = []
    for row in schedule.actions:
        held = peak = 0
        for action in row:
            held += {opened_by: 1, closed_by: -1}.get(action.kind, 0)
            peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


def rank_activation_bytes(program: CompiledProgram, rank: int) -> sympy.Expr:
    """Bytes `rank` saves for one forward of each module it runs over the example's global
    batch, summed (`module_activation_bytes`; under `compile=inductor` what the compiled
    forwards keep, `cost.compiled_activations`; memoised with the program's graph, and each
    distinct module with the capture's, `cost.memo.module_key`)."""
    captured, given = program.captured, set(program.input_names)
    pieces = boundary_pieces(program)

    def saved(m: fx.GraphModule) -> sympy.Expr:
        if program.plan.compile == "inductor":  # the partition the time model reads too
            return compiled_saved_bytes(module_graphs(program, m, rank), captured, given)
        key = module_key(m, sorted(pieces.items()), sorted(given))  # one trace per distinct module
        return memoised(captured.graph_module, f"module_activations.{key}",
                        lambda: module_activation_bytes(m, captured, given, pieces))

    return memoised(program.graph_module, f"rank_activations.{rank}", lambda: sympy.expand(sum(
        (saved(m) for m in program.stage_modules(rank)), sympy.Integer(0))))


def recomputed_nodes(captured: CapturedGraph, checkpoint: str) -> dict[fx.Node, str]:
    """The captured graph's nodes recomputed under `checkpoint`, with their regions."""
    graph = captured.graph_module.graph
    return region_labels(graph, checkpoint, block_lists(graph))


def saved_activation_bytes(captured: CapturedGraph, *, checkpoint: str = "none") -> sympy.Expr:
    """Bytes saved for backward by one forward of the captured graph over the example's
    (symbolic) global batch, under activation checkpointing `checkpoint` (module doc)."""
    return _total(captured_saved_bytes_by_node(captured, checkpoint=checkpoint))


def captured_saved_bytes_by_node(captured: CapturedGraph, *, checkpoint: str = "none") -> dict[str, sympy.Expr]:
    """`saved_activation_bytes` per node name of the captured graph, whose op saved them
    (memoised with the capture: every plan compiled from it asks the same)."""
    return memoised(captured.graph_module, f"saved_by_node.{checkpoint}",
                    lambda: {n.name: b for n, b in _captured_saved_bytes(captured, checkpoint).items()})


def _captured_saved_bytes(captured: CapturedGraph, checkpoint: str) -> dict[fx.Node, sympy.Expr]:
    gm = captured.graph_module
    real = dict(gm.named_parameters()) | dict(gm.named_buffers())
    getters = {
        n.target: (n.meta["val"], bool(getattr(real.get(n.target), "requires_grad", False)), None)
        for n in gm.graph.nodes if n.op == "get_attr"
    }
    runs = segments(gm.graph.nodes, recomputed_nodes(captured, checkpoint).get)
    return _saved_bytes(gm, captured, getters, runs)


def module_activation_bytes(module: fx.GraphModule, captured: CapturedGraph, given: set[str],
                            pieces: Pieces | None = None) -> sympy.Expr:
    """Bytes saved for backward by one forward of a rank's `module` (`saved_bytes_by_node`,
    summed): what the runtime's meter counts (`runtime.step.saved_tensors`)."""
    return _total(saved_bytes_by_node(module, captured, given, pieces))


def saved_bytes_by_node(module: fx.GraphModule, captured: CapturedGraph, given: set[str],
                        pieces: Pieces | None = None) -> dict[fx.Node, sympy.Expr]:
    """Bytes saved for backward by one forward of `module` (a rank's: its tensor-parallel
    shards, its pipeline stage, the checkpoint regions its pass marked, which
    `runtime.step.recompute` runs as the same `segments`; or the global graph the pipeline cut
    balances), per node whose op saved them, over the example's symbolic global batch. The
    inputs named in `given`, what a step gives its modules (the batch, the count of valid
    targets), are left out as the runtime's meter leaves them out; the inputs named in `pieces`
    are a rank's piece of them (`fake_inputs`)."""
    runs = segments(module.graph.nodes, meta.recompute_region)
    return _saved_bytes(module, captured, module_getters(module), runs, given=given, pieces=pieces)


def observe_fake_forward(module: fx.GraphModule, captured: CapturedGraph, given: set[str],
                         pieces: Pieces | None, observe) -> None:
    """Run `saved_bytes_by_node`'s fake forward of a rank's `module`, calling
    `observe(node, input values, value)` after each op: what else a fake forward can tell
    (`cost.workspace`)."""
    runs = segments(module.graph.nodes, meta.recompute_region)
    _saved_bytes(module, captured, module_getters(module), runs, given=given, pieces=pieces, observe=observe)


def _total(by_node: dict[fx.Node, sympy.Expr]) -> sympy.Expr:
    return sympy.expand(sum(by_node.values(), sympy.Integer(0)))


def module_getters(module: fx.GraphModule) -> dict:
    """A rank module's state for the fake forward: (tensor whose shape, stride and dtype to take,
    requires_grad, the dtype the graph computes it in or None) per get_attr target."""
    getters = {}
    for node in module.graph.nodes:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(module)
            if isinstance(value, torch.Tensor):
                # In the dtype the graph computes it in: bf16-mixed's working copy of an fp32
                # parameter (`passes.mixed_precision`), whatever the tensor holds before bind.
                computed = node.meta["val"].dtype if isinstance(node.meta.get("val"), torch.Tensor) else None
                getters[node.target] = (value, value.requires_grad, computed)
    return getters


def _saved_bytes(gm: fx.GraphModule, captured: CapturedGraph, getters: dict, runs: list[list[fx.Node]],
                 given: set[str] = frozenset(), pieces: Pieces | None = None,
                 observe=None) -> dict[fx.Node, sympy.Expr]:
    """The fake forward of the module doc over `gm`, its state given as (tensor whose shape,
    stride and dtype to take, requires_grad, another dtype or None) per get_attr target; the
    inputs named in `given` (the step's batch, which the step does not allocate) are not
    counted, like the state. Each storage's bytes go to the node whose op saved it first (a
    checkpointed run's kept inputs: to the run's last node). `observe`, where given, sees
    every op's fake inputs and value as the forward runs."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    inputs = fake_inputs(placeholders, pieces or {})
    fake_mode = detect_fake_mode([i for i in inputs if isinstance(i, torch.Tensor)])
    device = next(i.device for i in inputs if isinstance(i, torch.Tensor))  # the capture's (module doc)
    saved: list[tuple[torch.Tensor, fx.Node]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append((tensor, interpreter.running))
        return tensor

    with fake_mode, _dispatch_cache(fake_mode):
        state = {
            name: torch.empty_strided(value.shape, value.stride(), dtype=dtype or value.dtype, device=device)
            .requires_grad_(grad)
            for name, (value, grad, dtype) in getters.items()
        }
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            interpreter = _FakeStateInterpreter(gm, state, runs, saved, device, observe)
            interpreter.run(*inputs)
    state_storages = {t.untyped_storage()._cdata for t in (*state.values(), *interpreter.gathered)} | {
        value.untyped_storage()._cdata for n, value in zip(placeholders, inputs)
        if n.name in given and isinstance(value, torch.Tensor)
    }
    seen: set[int] = set()
    by_node: dict[fx.Node, sympy.Expr] = {}
    reaching = nodes_reaching_output(gm.graph)  # what the others save is freed with their values
    for tensor, node in saved:
        storage = tensor.untyped_storage()
        if storage._cdata in state_storages or storage._cdata in seen or node not in reaching:
            continue
        seen.add(storage._cdata)
        by_node[node] = by_node.get(node, sympy.Integer(0)) + captured.readable(storage.nbytes())
    return by_node


def fake_inputs(placeholders: list[fx.Node], pieces: Pieces) -> list:
    """The fake values a module's fake forward takes: a rank's piece of each
    (`cost.input_pieces`). A pipeline stage's received activations need a gradient, as the
    runtime receives them (`runtime.step.pipeline_executor`): the ops reading them save what
    that gradient needs (Llama's RMSNorm, the first op of a stage, saves its input only then)."""
    return [
        value.detach().requires_grad_() if isinstance(value, torch.Tensor) and meta.requires_grad(node) else value
        for node, value in zip(placeholders, piece_values(placeholders, pieces))
    ]


@contextlib.contextmanager
def _dispatch_cache(fake_mode):
    """Fake tensors' dispatch cache on for the fake forward (capture turns it off for export,
    where it costs more than it saves). A transformer's layers repeat the same ops on the same
    symbolic shapes, so every layer after the first hits it: a 48-layer GPT-3's forward takes
    2.8 s instead of 6.0. Cached outputs get storages of their own, as uncached ones do (views
    bypass the cache), so the storages counted are the same."""
    enabled, fake_mode.cache_enabled = fake_mode.cache_enabled, True
    try:
        yield
    finally:
        fake_mode.cache_enabled = enabled
